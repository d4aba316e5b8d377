"""Turn user prompts into validated token ids (the checks every entry point shares)."""

from __future__ import annotations

from typing import Any

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
        raise ValueError("prompt: empty prompt (no tokens)")
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"prompt: {len(token_ids)} tokens is longer than max_model_len={max_model_len}"
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
