"""The edge of the engine: user prompts and options -> one checked `EngineCoreRequest`.

`InputProcessor.process_inputs` is the only way a request is built, for the offline engine
and the server alike, so both refuse the same input the same way.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


def prompt_to_token_ids(
    prompt: PromptType, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) for a string or a {"prompt_token_ids": [...]} dict."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: empty prompt")
        if tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init is set)")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        token_ids = list(prompt["prompt_token_ids"])
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt_token_ids: every id must be an int in [0, {vocab_size})")
        return prompt.get("prompt"), token_ids
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt_to_token_ids(prompt["prompt"], tokenizer, vocab_size)
    raise ValueError(
        f"prompt: expected a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
    )


def check_prompt_length(token_ids: list[int], max_model_len: int) -> None:
    if not token_ids:
        raise InvalidRequestError("prompt: empty prompt (no tokens)", "prompt")
    if len(token_ids) > max_model_len:
        raise InvalidRequestError(
            f"prompt: {len(token_ids)} input tokens is more than the context window of "
            f"max_model_len={max_model_len} tokens",
            "input_tokens",
        )


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """The prompt's `cache_salt`: requests share cached KV only with others of the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt: must be a non-empty string")
    return salt


def bad_words_token_ids(bad_words: list[str] | None, tokenizer: Any) -> list[list[int]] | None:
    """Each bad word as token ids, with and without a leading space (as vLLM does)."""
    if not bad_words:
        return None
    sequences: list[list[int]] = []
    for word in bad_words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation as the model's chat template writes it (text, special tokens included)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "chat: the model has no chat template; pass chat_template=", "chat_template"
        )
    return tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )


class InputProcessor:
    """Tokenizes and validates requests against the engine's limits; shared by the offline
    engine and the server's API process, so both refuse the same input the same way."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text if known, the request for the core); ValueError naming the field at
        fault. `prompt` is a string or a dict with `prompt_token_ids` (or `prompt`), and
        optionally the prompt's text under `prompt` and a `cache_salt`."""
        text, token_ids = self.process_prompt(prompt, params)
        self.check_priority(priority)
        self.check_sampling_params(params)
        request = EngineCoreRequest(
            request_id,
            token_ids,
            params,
            sorted(self.config.model_config.eos_token_ids),
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            prompt_cache_salt(prompt),
            bad_words_token_ids(params.bad_words, self.tokenizer),
        )
        return text, request

    def process_prompt(
        self, prompt: PromptType, params: SamplingParams | None = None
    ) -> tuple[str | None, list[int]]:
        model_config = self.config.model_config
        text, token_ids = prompt_to_token_ids(prompt, self.tokenizer, model_config.vocab_size)
        if params is not None and params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        check_prompt_length(token_ids, model_config.max_model_len)
        return text, token_ids

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Checks that need the engine's limits (SamplingParams checks the rest itself)."""
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        if params.n > max_num_seqs:
            raise InvalidRequestError(f"n={params.n} is above max_num_seqs={max_num_seqs}", "n")
        limit = self.config.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequestError(
                    f"{name}={value} is above max_logprobs={limit} (an engine argument)", name
                )
        vocab_size = self.config.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            if any(token_id >= vocab_size for token_id in getattr(params, name) or ()):
                raise InvalidRequestError(f"{name}: token ids must be < {vocab_size}", name)
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words need a tokenizer (skip_tokenizer_init is set)", "bad_words"
            )
        if params.structured_outputs is not None:
            self.check_structured_outputs(params, "structured_outputs")

    def check_structured_outputs(self, params: SamplingParams, param: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs need a tokenizer (skip_tokenizer_init is set)", param
            )
        from pagedllm.structured_output.validation import validate_structured_outputs

        validate_structured_outputs(params.structured_outputs, param)

    def check_priority(self, priority: int) -> None:
        policy = self.config.scheduler_config.policy
        if priority != 0 and policy != "priority":
            raise InvalidRequestError(
                f"priority: {priority} given, but scheduling_policy is {policy!r}; "
                "use scheduling_policy='priority'",
                "priority",
            )
