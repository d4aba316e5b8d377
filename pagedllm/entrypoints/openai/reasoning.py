"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>…</think>` returned as
the message's `reasoning_content` and streamed as `delta.reasoning_content`, as vLLM does.
The split runs before the tool-call parser, which sees only the content (vLLM's order).

- `deepseek_r1` (DeepSeek-R1 and its distills): the template ends the prompt with `<think>`,
  so the answer starts inside the thinking and runs to `</think>`; an answer without
  `</think>` (cut short) is all reasoning.
- `qwen3` (Qwen3, QwQ): thinking may be absent. The answer is inside the thinking when it
  starts with `<think>` or when the prompt left a `<think>` open (the thinking-only 2507
  templates); otherwise it is all content (`enable_thinking: false`, instruct models).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # Whether the answer always starts inside the thinking (the prompt opened it).
    always_inside: bool

    def starts_inside(self, prompt: str) -> bool:
        """Whether the answer to `prompt` starts inside an open `<think>`."""
        return self.always_inside or prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)

    def split(self, text: str, inside: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished answer."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            text, inside = stripped[len(THINK_OPEN) :], True
        if not inside:
            return None, text
        reasoning, closed, content = text.partition(THINK_CLOSE)
        return reasoning or None, (content or None) if closed else None


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_inside=True),
    "qwen3": ReasoningParser("qwen3", always_inside=False),
}


class ReasoningStreamer:
    """One choice's streamed text split into (reasoning, content) pieces, the same split as
    `ReasoningParser.split`: a leading `<think>` and a partial `</think>` are held back
    until the next text says what they are."""

    def __init__(self, inside: bool) -> None:
        self.text = ""
        self.sent = 0  # characters of `text` already given out (or dropped tags)
        self.phase = "start"  # start (a leading `<think>` may come), reasoning, content
        self.inside = inside

    def delta(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.text += new_text
        reasoning = ""
        if self.phase == "start":
            self._start(finished)
        if self.phase == "reasoning":
            reasoning = self._reasoning(finished)
        content = self.text[self.sent :] if self.phase == "content" else ""
        if content:
            self.sent = len(self.text)
        return reasoning, content

    def _start(self, finished: bool) -> None:
        stripped = self.text.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.sent = len(self.text) - len(stripped) + len(THINK_OPEN)
            self.phase = "reasoning"
        elif THINK_OPEN.startswith(stripped) and not finished:
            return  # blank or a partial `<think>`: wait
        else:
            self.phase = "reasoning" if self.inside else "content"

    def _reasoning(self, finished: bool) -> str:
        close = self.text.find(THINK_CLOSE, self.sent)
        if close >= 0:
            piece = self.text[self.sent : close]
            self.sent, self.phase = close + len(THINK_CLOSE), "content"
            return piece
        end = len(self.text) if finished else _before_partial_close(self.text, self.sent)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


def _before_partial_close(text: str, start: int) -> int:
    """Where a cut-short `</think>` ends `text` (after `start`), else its end."""
    for size in range(len(THINK_CLOSE) - 1, 0, -1):
        if text.endswith(THINK_CLOSE[:size]) and len(text) - size >= start:
            return len(text) - size
    return len(text)
