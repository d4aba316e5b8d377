"""`POST /v1/embeddings` (OpenAI's): inputs as a string, strings, token ids or lists of
them; vectors as floats or base64 (little-endian float32, as OpenAI's); usage counted.
Needs an engine started with `--runner pooling`."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import EmbeddingRequest
from pagedllm.entrypoints.openai.serving import OpenAIServing, Prompt, now_s
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams


@dataclass
class PreparedEmbedding:
    """An embeddings request checked and converted (`prepare_embedding`): one prompt per
    input. `pagedllm run-batch` runs these through the offline `LLM.embed`."""

    lora_request: LoRARequest | None
    model_name: str
    prompts: list[Prompt]
    pooling_params: PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw: Request) -> JSONResponse:
        prepared = await self.prepare_embedding(request)
        request_id = self.request_id(raw, request, "embd")
        prompts = prepared.prompts
        results = self.generations(
            request_id,
            prompts,
            [POOLING_SAMPLING_PARAMS] * len(prompts),
            request,
            prepared.lora_request,
            pooling_params=prepared.pooling_params,
        )
        outputs: dict[int, PoolingRequestOutput] = {}
        async for index, output in results:
            outputs[index] = output
        body = embedding_response_body(
            request_id,
            prepared.model_name,
            [outputs[i] for i in range(len(prompts))],
            request.encoding_format,
        )
        return JSONResponse(body, headers={"X-Request-Id": request_id})

    async def prepare_embedding(self, request: EmbeddingRequest) -> PreparedEmbedding:
        """Every check and conversion before the engine: an error here is the client's 4xx."""
        if self.engine.config.pooler_config is None:
            raise OpenAIError(
                400,
                "this server generates; start it with --runner pooling to serve embeddings",
                "model",
            )
        lora_request = self.check_request(request, [])
        params = PoolingParams(normalize=request.normalize, dimensions=request.dimensions)
        self.engine.input_processor.check_pooling(params)
        prompts = await self.read_prompts(request.input, request.add_special_tokens, "input")
        return PreparedEmbedding(lora_request, self.response_model(lora_request), prompts, params)


def embedding_response_body(
    request_id: str,
    model_name: str,
    outputs: list[PoolingRequestOutput],
    encoding_format: str = "float",
) -> dict:
    """OpenAI's embeddings response for `outputs`, in input order."""
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encode_embedding(output.outputs.embedding, encoding_format),
        }
        for index, output in enumerate(outputs)
    ]
    num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": request_id,
        "object": "list",
        "created": now_s(),
        "model": model_name,
        "data": data,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
