"""The reasoning parsers (`--reasoning-parser`): `<think>…</think>` split into reasoning and
content as vLLM's qwen3 and deepseek_r1 parsers split it, whole and streamed."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningStreamer
from pagedllm.entrypoints.openai.server_config import ServerConfig

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
# The thinking-only templates (Qwen3 2507, DeepSeek-R1) open the thinking in the prompt.
OPEN_PROMPT = QWEN3_PROMPT + "<think>\n"

# (parser, prompt, answer, reasoning, content)
CASES = [
    (QWEN3, QWEN3_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!",
     "\nThe user greets.\n", "\n\nHello!"),
    (QWEN3, QWEN3_PROMPT, "Hello!", None, "Hello!"),  # no thinking: all content
    (QWEN3, QWEN3_PROMPT, "<think>\nStill thinking", "\nStill thinking", None),  # cut short
    (QWEN3, OPEN_PROMPT, "The user greets.\n</think>\n\nHello!", "The user greets.\n",
     "\n\nHello!"),
    (QWEN3, QWEN3_PROMPT + "<think>\n\n</think>\n\n", "Hello!", None, "Hello!"),  # thinking off
    (R1, QWEN3_PROMPT, "Okay, a greeting.\n</think>\n\nHello!", "Okay, a greeting.\n",
     "\n\nHello!"),
    (R1, QWEN3_PROMPT, "<think>Okay.</think>Hello!", "Okay.", "Hello!"),
    (R1, QWEN3_PROMPT, "Okay, a greeting and", "Okay, a greeting and", None),  # cut short
    (R1, QWEN3_PROMPT, "</think>Hello!", None, "Hello!"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "prompt", "text", "reasoning", "content"), CASES)
def test_split(parser, prompt, text, reasoning, content):
    assert parser.split(text, parser.starts_inside(prompt)) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(("parser", "prompt", "text", "reasoning", "content"), CASES)
def test_stream_adds_up_to_the_same_split(parser, prompt, text, reasoning, content, step):
    streamer = ReasoningStreamer(parser.starts_inside(prompt))
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    got = [streamer.delta(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert ("".join(r for r, _ in got) or None) == reasoning
    assert ("".join(c for _, c in got) or None) == content


def test_reasoning_streams_before_the_thinking_ends():
    streamer = ReasoningStreamer(inside=False)
    assert streamer.delta("<thi", finished=False) == ("", "")  # maybe a <think>: held
    assert streamer.delta("nk>Let me", finished=False) == ("Let me", "")
    assert streamer.delta(" see</th", finished=False) == (" see", "")  # a partial </think>
    assert streamer.delta("ink>Hi", finished=False) == ("", "Hi")
    assert streamer.delta(" there", finished=True) == ("", " there")


def test_server_config_names_the_parsers_it_knows():
    ServerConfig(("m",), reasoning_parser="deepseek_r1", tool_call_parser="qwen3_coder")
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerConfig(("m",), reasoning_parser="granite")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        ServerConfig(("m",), tool_call_parser="granite")
