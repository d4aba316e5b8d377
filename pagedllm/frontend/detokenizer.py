"""Incremental detokenization: a request's growing output token ids → text, step by step.

Owns, per request: decoding only the newest tokens (in a small window of context, never the
whole sequence), holding back a character whose UTF-8 bytes are still split across tokens,
and stop strings: finding them across token boundaries, cutting the text, and holding back
the streamed tail that a stop string completed later could still cut.

Not owned here: token-level stops (EOS, ``stop_token_ids``, ``max_tokens``), which the
scheduler applies, and turning finished requests into outputs (``llm_engine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first output token, so the first output token decodes
# as it would inside the full sequence (a SentencePiece word keeps its leading space).
PROMPT_CONTEXT_TOKENS = 5

# Tokens kept before the read offset as decoding context. One already-emitted token is what
# SentencePiece and byte-level BPE need; the cap keeps the window bounded even after an
# update that added many tokens at once.
MAX_CONTEXT_TOKENS = 8

# A UTF-8 character has at most 4 bytes, so the bytes of one unfinished character lie in at
# most 3 tokens (4 allows a skipped special token among them). Text that still ends in
# U+FFFD with more tokens than this pending is genuinely invalid, and is released as is.
MAX_PENDING_TOKENS = 4


class _Tokenizer(Protocol):
    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Decoding keeps two offsets into its token list: text up to ``read_offset`` has been
    emitted, and tokens from ``prefix_offset`` to ``read_offset`` (at most
    ``MAX_CONTEXT_TOKENS``) are context. Each update decodes ``[prefix, read)`` and
    ``[prefix, end)`` and emits the difference, so a token is decoded with its neighbours
    (leading spaces, byte-level merges) at a bounded cost per step. While the window's text
    ends in U+FFFD, a character's bytes are still split across tokens and nothing past the
    last complete character is emitted.

    The first output token gets the last ``PROMPT_CONTEXT_TOKENS`` prompt tokens as context,
    as in vLLM: for byte-level BPE ``output_text == tokenizer.decode(output_ids)``; for a
    SentencePiece tokenizer the text keeps the leading space of its first word, which a
    decode of the output ids alone would strip.

    Stop strings: after each update the new text is searched for every stop string (a match
    may begin in earlier text, so one spanning several tokens is found). The earliest match
    wins; at equal positions, the one listed first. The text is cut before the match, or after
    it with ``include_stop_str_in_output``, ``update`` returns the matched string, and the
    detokenizer is finished: a further ``update`` raises.

    Streaming: ``get_next_delta()`` returns the text not returned before. While unfinished
    it holds back the last ``max(len(s) for s in stop) - 1`` characters, the most a stop
    string completed by a later token could cut (none without stop strings or with
    ``include_stop_str_in_output``, where a cut never reaches text that existed before the
    update that completes the match). When the request ends for any other reason (EOS,
    ``max_tokens``, abort), call ``finish()``: it decodes tokens still held back for an
    incomplete character (any invalid bytes become U+FFFD) and releases the held-back
    characters to the next ``get_next_delta()``.

    ``spaces_between_special_tokens`` is passed to ``tokenizer.decode``; Transformers' fast
    tokenizers ignore it.
    """

    def __init__(
        self,
        tokenizer: _Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # As vLLM: stop strings count only once min_tokens output tokens exist.
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        # Only the prompt's tail is ever decoded, so only the tail is kept.
        tail_start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._token_ids: list[int] = [int(t) for t in prompt_token_ids[tail_start:]]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        # An empty stop string would match everywhere; it can only be a mistake.
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        longest = max((len(s) for s in self._stop), default=0)
        self._hold_chars = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self._text = ""
        self._num_sent = 0
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text so far, cut at a matched stop string as ``update`` describes.

        Includes the characters ``get_next_delta`` still holds back, so until the detokenizer
        finishes its tail may yet be cut by a stop string that a later token completes.
        """
        return self._text

    @property
    def finished(self) -> bool:
        """True once a stop string matched or ``finish()`` was called."""
        return self._finished

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop_reason

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append tokens; return the stop string that matched (and cut the text) or None."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.update after it finished")
        self._token_ids.extend(int(t) for t in new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        old_len = len(self._text)
        self._text += self._decode_pending(final=False)
        if self._num_output_tokens < self._min_tokens:
            return None
        return self._check_stop(old_len)

    def finish(self) -> None:
        """End the text for a reason other than a stop string; releases all held-back text.

        Idempotent. Tokens held back for an incomplete character are decoded as they are; if
        that completes a stop string, the text is cut as in ``update``.
        """
        if self._finished:
            return
        old_len = len(self._text)
        self._text += self._decode_pending(final=True)
        self._check_stop(old_len)
        self._finished = True

    def get_next_delta(self) -> str:
        """Text not returned by earlier calls, possibly ""; see the class docstring."""
        end = len(self._text)
        if not self._finished:
            end = max(self._num_sent, end - self._hold_chars)
        delta = self._text[self._num_sent : end]
        self._num_sent = end
        return delta

    # ------------------------------------------------------------------ internals

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, **self._decode_kwargs)

    def _decode_pending(self, final: bool) -> str:
        """Text of the tokens past the read offset, decoded in context; "" while held back."""
        ids = self._token_ids
        end = len(ids)
        if end == self._read_offset:
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset : end])
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            end, new_text = self._last_complete_end(end, new_text, prefix_text)
            if end == self._read_offset:
                return ""
        # Decoding a longer window normally only appends. When it does not (a tokenizer's
        # clean-up pass or invalid bytes), text already emitted cannot be taken back, so the
        # part past the old length is the best continuation.
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = max(self._read_offset, end - MAX_CONTEXT_TOKENS)
        self._read_offset = end
        return delta

    def _last_complete_end(self, end: int, new_text: str, prefix_text: str) -> tuple[int, str]:
        """(end, window text) for the longest run of pending tokens that ends a character.

        Called when the text up to ``end`` ends in U+FFFD. A multi-token update may end in
        the middle of a character yet hold complete text before it, so up to
        ``MAX_PENDING_TOKENS`` shorter ends are tried. If none ends cleanly and more tokens
        than that are pending, the bytes are invalid rather than unfinished: release them.
        """
        ids = self._token_ids
        lowest = max(self._read_offset + 1, end - MAX_PENDING_TOKENS)
        for candidate in range(end - 1, lowest - 1, -1):
            text = self._decode(ids[self._prefix_offset : candidate])
            if not text.endswith(_REPLACEMENT_CHAR):
                return candidate, text
        if end - self._read_offset > MAX_PENDING_TOKENS:
            return end, new_text
        return self._read_offset, prefix_text

    def _check_stop(self, old_len: int) -> str | None:
        """Find a stop string completed by the text after ``old_len``; cut the text at it."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # A match ending in the new text may start up to len(stop) - 1 characters back.
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[: index + len(stop) if self._include_stop else index]
        # The hold-back rule guarantees no streamed character is cut.
        assert self._num_sent <= len(self._text), "streamed text was cut by a stop string"
        self._stop_reason = stop
        self._finished = True
        return stop
