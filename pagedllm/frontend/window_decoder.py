"""Token ids → text in a small sliding window, by any tokenizer's ``decode``.

Owns the offsets that say which tokens were emitted and which are context, and holding back
a character whose UTF-8 bytes are still split across tokens. It works with every tokenizer
(slow ones, wrappers that only have ``decode``), and is what ``decode_stream.py`` hands over
to when its fast path cannot go on. Stop strings are ``detokenizer.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["MAX_PENDING_TOKENS", "REPLACEMENT_CHAR", "WindowDecoder"]

REPLACEMENT_CHAR = "\ufffd"

# Tokens kept before the read offset as decoding context. One already-emitted token is what
# SentencePiece and byte-level BPE need; the cap keeps the window bounded even after an
# update that added many tokens at once.
MAX_CONTEXT_TOKENS = 8

# A UTF-8 character has at most 4 bytes, so the bytes of one unfinished character lie in at
# most 3 tokens (4 allows a skipped special token among them). Text that still ends in
# U+FFFD with more tokens than this pending is genuinely invalid, and is released as is.
MAX_PENDING_TOKENS = 4


class WindowDecoder:
    """Turns a growing list of token ids into text, decoding only a window at each step.

    Two offsets into the token list: text up to ``read_offset`` has been emitted, and tokens
    from ``prefix_offset`` to ``read_offset`` (at most ``MAX_CONTEXT_TOKENS``) are context.
    Each step decodes ``[prefix, read)`` and ``[prefix, end)`` and emits the difference, so a
    token is decoded with its neighbours (leading spaces, byte-level merges) at a bounded
    cost. While the window's text ends in U+FFFD, a character's bytes are still split across
    tokens and nothing past the last complete character is emitted.

    ``context_ids`` are tokens whose text is not this decoder's to emit (the prompt's tail);
    ``pending_ids`` follow them and are decoded by the next ``push``.
    """

    name = "window"

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        context_ids: Sequence[int],
        pending_ids: Sequence[int] = (),
    ) -> None:
        self._decode_ids = decode
        self._token_ids = [*context_ids, *pending_ids]
        self._prefix_offset = 0
        self._read_offset = len(context_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens pushed whose text is not emitted yet (an unfinished character's)."""
        return len(self._token_ids) - self._read_offset

    @property
    def context_ids(self) -> list[int]:
        """The emitted tokens the next token is decoded after."""
        return self._token_ids[self._prefix_offset : self._read_offset]

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is split)."""
        self._token_ids.extend(token_ids)
        return self._decode_pending(final=False)

    def flush(self) -> str:
        """Decode the held-back tokens as they are (invalid bytes become U+FFFD)."""
        return self._decode_pending(final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""

    def _decode_pending(self, final: bool) -> str:
        """Text of the tokens past the read offset, decoded in context; "" while held back."""
        ids = self._token_ids
        end = len(ids)
        if end == self._read_offset:
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset : end])
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            end, new_text = self._last_complete_end(end, new_text, prefix_text)
            if end == self._read_offset:
                return ""
        # Decoding a longer window normally only appends. When it does not (a tokenizer's
        # clean-up pass or invalid bytes), text already emitted cannot be taken back, so the
        # part past the old length is the best continuation.
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = max(self._read_offset, end - MAX_CONTEXT_TOKENS)
        self._read_offset = end
        # Only the window is ever decoded again, so only the window is kept.
        del ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
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
            if not text.endswith(REPLACEMENT_CHAR):
                return candidate, text
        if end - self._read_offset > MAX_PENDING_TOKENS:
            return end, new_text
        return self._read_offset, prefix_text
