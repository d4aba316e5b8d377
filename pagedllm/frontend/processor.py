"""The edge of the engine: user prompts and options -> one checked `EngineCoreRequest`.

`InputProcessor.process_inputs` is the only way a request is built, for the offline engine
and the server alike, so both refuse the same input the same way.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.messages import EngineCoreRequest
from pagedllm.core.request import CHILD_SEPARATOR
from pagedllm.errors import InvalidRequestError
from pagedllm.frontend.chat_template import DEFAULT_MAX_OUTPUT_CHARS, apply_chat_template
from pagedllm.lora.peft import LoRAAdapterError, projection_shapes, read_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.value_checks import check_int, check_text, short_repr

PromptType = str | dict[str, Any]
# Template variables the renderer sets from the request's own fields.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message"}
)


def prompt_to_token_ids(
    prompt: PromptType, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) for a string or a {"prompt_token_ids": [...]} dict."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: empty prompt")
        if tokenizer is None:
            raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init is set)")
        check_text("prompt", prompt)  # a lone surrogate: tokenizers raise TypeError
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        token_ids = check_token_ids(prompt["prompt_token_ids"], vocab_size, "prompt_token_ids")
        text = prompt.get("prompt")
        if text is not None:
            check_text("prompt", text)
        return text, token_ids
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt_to_token_ids(prompt["prompt"], tokenizer, vocab_size)
    raise ValueError(
        f"prompt: expected a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
    )


def check_token_ids(token_ids: Any, vocab_size: int, param: str) -> list[int]:
    """`token_ids` as a list of ints each in [0, vocab_size); InvalidRequestError naming
    `param` (the field that carried them) otherwise."""
    if isinstance(token_ids, str | bytes | dict) or not hasattr(token_ids, "__iter__"):
        raise InvalidRequestError(f"{param}: must be a list of token ids", param)
    token_ids = list(token_ids)
    if all(type(t) is int for t in token_ids) and (
        not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size)
    ):
        return token_ids  # the common case, in C loops
    for index, token_id in enumerate(token_ids):
        try:
            token_ids[index] = check_int(param, token_id, 0, vocab_size - 1)
        except ValueError:
            raise InvalidRequestError(
                f"{param}: every id must be an int in [0, {vocab_size}); "
                f"item {index} is {short_repr(token_id)}",
                param,
            ) from None
    return token_ids


def check_request_id(request_id: object) -> None:
    """A non-empty string without `CHILD_SEPARATOR` ("#"): the scheduler names the samples
    it forks for n > 1 `<id>#<i>` (`core.request.child_request_id`), and an id equal to one
    of those would collide with it inside the engine core."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id: must be a non-empty string", "request_id")
    if CHILD_SEPARATOR in request_id:
        raise InvalidRequestError(
            f"request_id: {CHILD_SEPARATOR!r} is reserved for the engine's parallel samples",
            "request_id",
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
    return salt if salt is None else check_text("cache_salt", salt)


MAX_TENANT_LENGTH = 256
# Adapters whose check is remembered (older ones are read again when next named).
MAX_CHECKED_ADAPTERS = 1024


def check_tenant(tenant: object) -> None:
    """A tenant is None (the default tenant) or a non-empty name of bounded length."""
    if tenant is None:
        return
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LENGTH:
        raise InvalidRequestError(
            f"tenant: must be a non-empty string of at most {MAX_TENANT_LENGTH} characters",
            "tenant",
        )


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
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
) -> str:
    """The conversation as the model's chat template writes it (text, special tokens included),
    rendered in the sandbox within a time and size bound (`frontend/chat_template.py`)."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs: {reserved[0]!r} is set by the request itself",
            "chat_template_kwargs",
        )
    # vLLM reads a template passed among the kwargs as the template (the argument wins).
    kwargs_template = kwargs.pop("chat_template", None)
    chat_template = kwargs_template if chat_template is None else chat_template
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "chat: the model has no chat template; pass chat_template=", "chat_template"
        )
    return apply_chat_template(
        tokenizer,
        conversation,
        add_generation_prompt and not continue_final_message,
        continue_final_message,
        chat_template,
        kwargs,
        max_output_chars=max_output_chars,
    )


class InputProcessor:
    """Tokenizes and validates requests against the engine's limits; shared by the offline
    engine and the server's API process, so both refuse the same input the same way."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # LoRA adapters already read and found servable: (id, path), least recent first.
        self._checked_adapters: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._checked_lock = threading.Lock()

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text if known, the request for the core); ValueError naming the field at
        fault. `prompt` is a string or a dict with `prompt_token_ids` (or `prompt`), and
        optionally the prompt's text under `prompt` and a `cache_salt`. `tenant`: who the
        request runs for (the "fair" policy shares the engine between tenants).
        `pooling_params` makes it an embedding request (a runner="pooling" engine takes
        only those; `params` is then ignored)."""
        check_request_id(request_id)
        if self.check_pooling(pooling_params):
            params = POOLING_SAMPLING_PARAMS
        text, token_ids = self.process_prompt(prompt, params)
        self.check_priority(priority)
        check_tenant(tenant)
        self.check_sampling_params(params)
        self.check_lora_request(lora_request)
        request = EngineCoreRequest(
            request_id,
            token_ids,
            params,
            sorted(self.config.model_config.eos_token_ids),
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            prompt_cache_salt(prompt),
            bad_words_token_ids(params.bad_words, self.tokenizer),
            tenant=tenant,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        return text, request

    def check_pooling(self, pooling_params: PoolingParams | None) -> bool:
        """Whether the request is an embedding request; one the engine's runner does not
        run, or asking for a length the model cannot give, is refused naming the field."""
        pooling = self.config.pooler_config is not None
        if pooling_params is None:
            if pooling:
                raise InvalidRequestError(
                    "this engine runs runner='pooling': it embeds (/v1/embeddings, "
                    "LLM.embed) and does not generate",
                    "model",
                )
            return False
        if not pooling:
            raise InvalidRequestError(
                "this engine runs runner='generate': start it with runner='pooling' "
                "(--runner pooling) to embed",
                "model",
            )
        if not isinstance(pooling_params, PoolingParams):
            raise InvalidRequestError("pooling_params: must be a PoolingParams", "pooling_params")
        hidden_size = self.config.model_config.hf_config.hidden_size
        if pooling_params.dimensions is not None and pooling_params.dimensions != hidden_size:
            raise InvalidRequestError(
                f"dimensions: this model's embeddings have {hidden_size} dimensions and it "
                "was not trained for shorter ones (Matryoshka); leave dimensions out or give "
                f"{hidden_size}",
                "dimensions",
            )
        return True

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """An adapter must be served by this engine and readable (`check_lora_adapter`)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError("lora_request: must be a LoRARequest", "lora_request")
        try:
            self.check_lora_adapter(lora_request)
        except LoRAAdapterError as error:
            raise InvalidRequestError(f"lora_request: {error}", "lora_request") from None

    def check_lora_adapter(self, lora_request: LoRARequest) -> None:
        """Read the adapter and check it against the model, once per (id, path); raises
        `LoRAAdapterError` naming the problem. Safe from any thread: the server checks a new
        adapter off its event loop, so its first request finds it checked."""
        lora_config = self.config.lora_config
        if lora_config is None:
            raise LoRAAdapterError("this engine was started without enable_lora")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        with self._checked_lock:
            if key in self._checked_adapters:
                self._checked_adapters.move_to_end(key)
                return
        read_adapter(
            lora_request, projection_shapes(self.config.model_config), lora_config.max_lora_rank
        )
        with self._checked_lock:
            self._checked_adapters[key] = None
            if len(self._checked_adapters) > MAX_CHECKED_ADAPTERS:
                self._checked_adapters.popitem(last=False)

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
        priority = check_int("priority", priority)
        policy = self.config.scheduler_config.policy
        if priority != 0 and policy != "priority":
            raise InvalidRequestError(
                f"priority: {priority} given, but scheduling_policy is {policy!r}; "
                "use scheduling_policy='priority'",
                "priority",
            )
