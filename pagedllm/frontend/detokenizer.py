"""Incremental detokenization: a request's growing output token ids → text, step by step.

Owns, per request: stop strings (finding them across token boundaries, cutting the text)
and holding back the streamed tail that a stop string completed later could still cut.
Turning tokens into text is a token decoder's (``token_decoder.py`` picks ``DecodeStream``
or the window decoder); both hold back a character whose UTF-8 bytes are still split.

Not owned here: token-level stops (EOS, ``stop_token_ids``, ``max_tokens``), which the
scheduler applies, and turning finished requests into outputs (``llm_engine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.frontend.token_decoder import make_token_decoder

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time.

    Decoding: each update decodes only the new tokens, in a little context, by the token
    decoder ``make_token_decoder`` picks: ``tokenizers``' ``DecodeStream`` for a fast
    tokenizer (``use_decode_stream=False`` turns it off), otherwise a window of at most a
    few tokens through ``tokenizer.decode``. Both give the same text. While the text ends in
    a character whose bytes are split across tokens, nothing past the last complete
    character is emitted.

    The first output token gets the last few prompt tokens as context, as in vLLM: for
    byte-level BPE ``output_text == tokenizer.decode(output_ids)``; for a SentencePiece
    tokenizer the text keeps the leading space of its first word, which a decode of the
    output ids alone would strip.

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
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        use_decode_stream: bool = True,
    ) -> None:
        self._decoder = make_token_decoder(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens,
            spaces_between_special_tokens,
            use_decode_stream,
        )
        # As vLLM: stop strings count only once min_tokens output tokens exist.
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
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
    def decoder_name(self) -> str:
        """Which token decoder this request uses: "decode_stream" or "window"."""
        return self._decoder.name

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
        self._num_output_tokens += len(new_token_ids)
        old_len = len(self._text)
        self._text += self._decoder.push([int(t) for t in new_token_ids])
        # A match must end in new text; most steps have no stop strings to look for.
        if not self._stop or len(self._text) == old_len:
            return None
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
        self._text += self._decoder.flush()
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
