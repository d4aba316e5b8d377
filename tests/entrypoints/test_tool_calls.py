"""Parsing `tool_choice: "required"` answers: every complete call is kept, also when
max_tokens cut the answer short in the middle of a later call (vLLM keeps them too)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import ToolCallStreamer, plan_tools

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
WHOLE = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]'
)


def required_plan():
    return plan_tools(TOOLS, "required", True, None)


@pytest.mark.parametrize(
    ("cut", "expected"),
    [
        (len(WHOLE), ["get_weather", "get_time"]),
        (WHOLE.index(", {") + 1, ["get_weather"]),  # after the first call's comma
        (WHOLE.index('"get_time"') + 4, ["get_weather"]),  # inside the second call
        (WHOLE.index("Paris"), []),  # inside the first call
        (0, []),
    ],
)
def test_required_keeps_every_complete_call_when_cut_short(cut, expected):
    content, calls = required_plan().parse(WHOLE[:cut])
    assert content is None
    assert [call.name for call in calls] == expected
    if expected:
        assert json.loads(calls[0].arguments) == {"city": "Paris"}


def test_a_streamed_required_answer_cut_short_ends_with_its_complete_calls():
    streamer = ToolCallStreamer(required_plan())
    cut = WHOLE.index('"get_time"')
    assert streamer.delta(WHOLE[:10], finished=False) == {}
    delta = streamer.delta(WHOLE[10:cut], finished=True)
    assert [call["function"]["name"] for call in delta["tool_calls"]] == ["get_weather"]
    assert streamer.made_calls
