"""The offline API, as vLLM's: `LLM(model=...)`, `generate`, `chat`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.frontend.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedllm.frontend.llm_engine import LLMEngine
from pagedllm.frontend.processor import PromptType, render_chat
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import EngineStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.runner.model_runner import ModelRunner

Conversation = list[dict[str, Any]]
# Told each request's final output as it finishes: (its position in the prompts, the output).
OnFinished = Callable[[int, Any], None]


class LLM:
    """Offline batch generation on one engine.

    `model` is a Hugging Face directory, a `.gguf` file, or None for the default
    SmolLM2-135M-Instruct; every other keyword is an engine argument (`EngineArgs`).
    `data_parallel_size=N` runs N engine cores (each a whole model copy, its own scheduler
    and KV cache) in this process; each prompt goes to the core that holds most of its
    prefix unless that one is clearly busier, else to the least loaded.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @property
    def model_runner(self) -> ModelRunner | None:
        """The sampling rank's `ModelRunner` when it runs in this process (one rank), for
        inspection and benchmarks: its model, KV cache, `add_forward_observer`. None when
        the workers run in processes of their own; with data parallelism, the first core's."""
        return self.llm_engine.engine_core.model_executor.in_process_runner

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order (and, with
        `on_finished`, are handed to it one by one as each request finishes).

        A prompt is a string or a dict with `prompt_token_ids` (or `prompt`) and an
        optional `cache_salt`; `lora_request` (one for all prompts, or one each, None for
        the base model) needs enable_lora; `priority` (one per prompt, lower first) needs
        scheduling_policy="priority".

        A request that fails on its own in the engine (its logits processors, grammar,
        parallel-sample fork or detokenization raised) does not raise here: it comes back
        finished with `finish_reason="error"` and the message in its `CompletionOutput.error`
        (`RequestOutput.error`), and every other request's output is what it would have been.
        """
        engine = self.llm_engine
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority: got {len(priorities)} for {len(prompt_list)} prompts")
        loras = _per_prompt("lora_request", lora_request, len(prompt_list))
        # Offline callers want one output per request, at the end.
        params_list = [
            dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            for params in params_list
        ]
        # Tokenize and validate everything first so bad input leaves nothing half-queued.
        processed = [
            engine.process_inputs(
                str(next(self._request_counter)), prompt, params, value, lora_request=lora
            )
            for prompt, params, value, lora in zip(
                prompt_list, params_list, priorities, loras, strict=True
            )
        ]
        return self._add_and_run(processed, use_tqdm, on_finished)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[PoolingRequestOutput]:
        """One embedding per prompt, in input order (needs runner="pooling"): the prompt's
        final hidden states pooled as `pooler_config` says (`outputs.embedding`); each also
        handed to `on_finished` as it finishes, as `generate`'s."""
        engine = self.llm_engine
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if prompt_list and isinstance(prompt_list[0], int):  # one prompt of token ids
            prompt_list = [prompt_list]
        prompt_list = [_as_prompt(prompt) for prompt in prompt_list]
        params_list = _per_prompt(
            "pooling_params", pooling_params or PoolingParams(), len(prompt_list)
        )
        loras = _per_prompt("lora_request", lora_request, len(prompt_list))
        processed = [
            engine.process_inputs(
                str(next(self._request_counter)),
                prompt,
                POOLING_SAMPLING_PARAMS,
                lora_request=lora,
                pooling_params=params,
            )
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True)
        ]
        return self._add_and_run(processed, use_tqdm, on_finished)

    def _add_and_run(self, processed: list, use_tqdm: bool, on_finished: OnFinished | None):
        """Queue the checked requests, then step the engine until they are all done."""
        for prompt_text, request in processed:
            self.llm_engine.add_processed_request(prompt_text, request)
        request_ids = [request.request_id for _, request in processed]
        return self._run_engine(request_ids, use_tqdm, on_finished)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """The best `params.beam_width` continuations of each prompt (frontend/beam_search.py)."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        loras = _per_prompt("lora_request", lora_request, len(prompt_list))
        return beam_search(self.llm_engine, self.generate, prompt_list, params, use_tqdm, loras)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (refused while requests run)."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self._render_chat(
                    conversation,
                    add_generation_prompt,
                    continue_final_message,
                    chat_template,
                    chat_template_kwargs or {},
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _render_chat(
        self,
        conversation,
        add_generation_prompt,
        continue_final_message,
        chat_template,
        chat_template_kwargs,
    ) -> list[int]:
        text = render_chat(
            self.llm_engine.tokenizer,
            conversation,
            add_generation_prompt,
            continue_final_message,
            chat_template,
            chat_template_kwargs,
        )
        # The template already holds any special tokens the model expects.
        return self.llm_engine.tokenizer.encode(text, add_special_tokens=False)

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool, on_finished: OnFinished | None = None
    ) -> list:
        outputs: dict[str, RequestOutput] = {}
        position = {request_id: i for i, request_id in enumerate(request_ids)}
        pending = set(request_ids)
        started = time.perf_counter()
        num_tokens = 0
        unit = "input" if self.llm_engine.config.pooler_config is not None else "output"
        with tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        ) as progress:
            while pending:
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        outputs[output.request_id] = output
                        if on_finished is not None:
                            on_finished(position[output.request_id], output)
                        if isinstance(output, RequestOutput):
                            num_tokens += len(output.outputs[0].token_ids)
                        else:
                            num_tokens += len(output.prompt_token_ids)
                        elapsed = max(time.perf_counter() - started, 1e-9)
                        progress.set_postfix_str(f"{unit} {num_tokens / elapsed:.1f} tok/s")
                        progress.update(1)
        return [outputs[request_id] for request_id in request_ids]


def _as_prompt(prompt: Any) -> Any:
    """A list of token ids is the prompt of those ids."""
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    return prompt


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    return _per_prompt("sampling_params", sampling_params, num_prompts)


def _per_prompt(name: str, value: Any, num_prompts: int) -> list[Any]:
    """One value for every prompt: a single value (or None) is shared, a list has one each."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(
            f"{name}: got {len(values)} for {num_prompts} prompts; give one, or one each"
        )
    return values
