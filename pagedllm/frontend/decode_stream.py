"""Token ids → text through ``tokenizers.decoders.DecodeStream``, the Rust incremental decoder.

Owns the fast path of detokenization for tokenizers backed by a ``tokenizers.Tokenizer``:
one Rust call per token instead of two Python ``tokenizer.decode`` calls. It keeps the
window decoder's results: the stream is primed with the prompt's tail, as the window is,
and whenever the stream cannot go on as the window would (bytes that never complete a
character, a decode that rewrites earlier text, the final flush of an unfinished one), the
tokens it holds are handed to a ``WindowDecoder``, which settles them; the stream starts
again from that decoder's context once nothing is pending. Stop strings are
``detokenizer.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from pagedllm.frontend.window_decoder import MAX_PENDING_TOKENS, REPLACEMENT_CHAR, WindowDecoder

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Incremental text of a growing list of token ids, decoded by a ``DecodeStream``.

    The stream emits a token's text once it ends in a complete character and adds to the
    text before it; it then keeps the tokens of that emission as context for the next. This
    mirrors that state (``_context_ids``, ``_pending_ids``) so that a hand-over gives the
    window decoder exactly the window the stream was decoding.

    ``backend`` is the Hugging Face tokenizer's ``tokenizers.Tokenizer``; its ``decode`` must
    be what the Hugging Face tokenizer's is (``token_decoder.stream_backend`` checks that).
    """

    name = "decode_stream"

    def __init__(self, backend: Any, context_ids: Sequence[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream: DecodeStream | None = None
        self._window: WindowDecoder | None = None
        self._context_ids: list[int] = []
        self._pending_ids: list[int] = []
        self._start_stream(list(context_ids))

    @property
    def num_pending_tokens(self) -> int:
        """Tokens pushed whose text is not emitted yet (an unfinished character's)."""
        if self._window is not None:
            return self._window.num_pending_tokens
        return len(self._pending_ids)

    @property
    def streaming(self) -> bool:
        """False while the window decoder holds the tokens (invalid bytes, a rewritten text)."""
        return self._window is None

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is split)."""
        if len(token_ids) == 1:  # the usual step: no list, no join
            text = self._push_one(token_ids[0])
        else:  # one token at a time, so text before a split character is emitted at once
            text = "".join([self._push_one(token_id) for token_id in token_ids])
        if len(self._pending_ids) > MAX_PENDING_TOKENS:
            # Invalid bytes, or tokens that add no text: the window decoder releases them
            # as it always has; the stream would hold them (and re-decode them) forever.
            # Checked once per update, as the window decoder checks, so that a character
            # completed later in the same update is still decoded whole.
            text += self._settle_in_window()
        return text

    def flush(self) -> str:
        """Decode the held-back tokens as they are (invalid bytes become U+FFFD)."""
        if self._window is None and not self._pending_ids:
            return ""
        window = self._hand_over()
        text = window.flush()
        self._rejoin(window)
        return text

    # ------------------------------------------------------------------ internals

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _push_one(self, token_id: int) -> str:
        stream = self._stream
        if stream is None:
            assert self._window is not None
            text = self._window.push([token_id])
            self._rejoin(self._window)
            return text
        try:
            text = stream.step(self._backend, token_id)
        except Exception:  # the text before this token changed: the window decoder settles it
            self._pending_ids.append(token_id)
            return self._settle_in_window()
        if text is not None:
            self._context_ids = [*self._pending_ids, token_id]
            self._pending_ids = []
            return text
        self._pending_ids.append(token_id)
        return ""

    def _settle_in_window(self) -> str:
        window = self._hand_over()
        text = window.push([])
        self._rejoin(window)
        return text

    def _hand_over(self) -> WindowDecoder:
        """The window decoder in the stream's place, at the stream's offsets."""
        if self._window is None:
            self._window = WindowDecoder(self._decode, self._context_ids, self._pending_ids)
            self._stream, self._context_ids, self._pending_ids = None, [], []
        return self._window

    def _rejoin(self, window: WindowDecoder) -> None:
        """Go back to the stream once the window holds nothing back."""
        if window.num_pending_tokens == 0:
            self._start_stream(window.context_ids)

    def _start_stream(self, context_ids: list[int]) -> None:
        """A stream primed with ``context_ids``; the window decoder instead when their text
        ends in U+FFFD, since the stream, which cannot take that text as its prefix, would
        emit the context's own text again."""
        if self._decode(context_ids).endswith(REPLACEMENT_CHAR):
            if self._window is None:
                self._window = WindowDecoder(self._decode, context_ids)
            return
        self._stream = DecodeStream(context_ids, skip_special_tokens=self._skip_special_tokens)
        self._window, self._context_ids, self._pending_ids = None, context_ids, []
