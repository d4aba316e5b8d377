"""Which decoder turns a request's output token ids into text, and its priming with the prompt.

Owns the choice: ``DecodeStream`` (``decode_stream.py``) where the tokenizer is a fast one
whose ``decode`` is exactly its ``tokenizers.Tokenizer``'s, the window decoder
(``window_decoder.py``) for every other tokenizer. Both are primed with the prompt's tail,
so the first output token decodes as it does after the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pagedllm.frontend.decode_stream import StreamDecoder
from pagedllm.frontend.window_decoder import WindowDecoder

__all__ = [
    "PROMPT_CONTEXT_TOKENS",
    "TokenDecoder",
    "make_token_decoder",
    "stream_backend",
    "token_text_decoder",
]

# Prompt tokens decoded ahead of the first output token, so the first output token decodes
# as it would inside the full sequence (a SentencePiece word keeps its leading space).
PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    """Incremental text of a growing list of token ids."""

    name: str

    @property
    def num_pending_tokens(self) -> int: ...

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


def make_token_decoder(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    use_decode_stream: bool = True,
) -> TokenDecoder:
    """The decoder for one request's output; ``use_decode_stream=False`` forces the window
    decoder (for comparisons: both give the same text)."""
    tail_start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
    context_ids = [int(t) for t in prompt_token_ids[tail_start:]]
    backend = stream_backend(tokenizer) if use_decode_stream else None
    if backend is not None:
        # Fast tokenizers ignore spaces_between_special_tokens, so the stream needs no say.
        return StreamDecoder(backend, context_ids, skip_special_tokens)

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    return WindowDecoder(decode, context_ids)


def token_text_decoder(tokenizer: Any) -> Callable[[int], str]:
    """One token's text as ``tokenizer.decode([token_id])`` gives it (logprobs' strings), by
    the ``tokenizers.Tokenizer`` where its decode is the same, without Python's layers."""
    backend = stream_backend(tokenizer)
    if backend is None:
        return lambda token_id: tokenizer.decode([token_id])
    return lambda token_id: backend.decode([token_id], skip_special_tokens=False)


def stream_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` gives exactly ``tokenizer.decode``'s text,
    or None: a slow tokenizer, one whose class changes decoding, or one that cleans up
    spaces after decoding (which the stream would not)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if (
        cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
    ):
        return None
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend, Tokenizer) or _cleans_up_spaces(tokenizer, backend):
        return None
    return backend


def _cleans_up_spaces(tokenizer: Any, backend: Any) -> bool:
    """Whether ``decode`` rewrites spaces after the backend's decode (Transformers skips that
    for BPE models unless forced)."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return type(backend.model).__name__ != "BPE" or bool(forced)
