"""The `tool_choice: "auto"` parsers on each format's real text (as the model families write it
and vLLM's parser of the same name reads it): one call, several, content around them,
malformed calls left as content, and streamed deltas that add up to the same answer whatever
the text's cut into."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import ToolCallStreamer, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "scale": {"type": "number"},
        "tags": {"type": "array"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {"zone": "UTC"})

# (parser, text, content, calls)
CASES = [
    # hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
     "\n</tool_call>", None, [PARIS]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"zone": "UTC"}}\n</tool_call>', "Let me check.", [PARIS, TIME]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),
    # llama3_json: Llama 3.1's JSON answer, with "parameters"; several joined by ";"
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
     None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"days": 2}}; {"name": "get_time", "parameters": {"zone": "UTC"}}', None, [PARIS, TIME]),
    ("llama3_json", 'I will look it up. <|python_tag|>{"name": "get_time", "arguments": '
     '{"zone": "UTC"}}', "I will look it up.", [TIME]),
    ("llama3_json", "The weather in Paris is mild, about {15} degrees.",
     "The weather in Paris is mild, about {15} degrees.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # plain JSON, not a call
    # mistral: v0.3's JSON array, and the newer tokenizers' name{...} / name[ARGS]{...}
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 2}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [PARIS, TIME]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather{"city": "Paris", "days": 2}'
     '[TOOL_CALLS]get_time{"zone": "UTC"}', "Sure.", [PARIS, TIME]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, [TIME]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa', []),
    ("mistral", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    # pythonic: a Python list of calls, literals only
    ("pythonic", '[get_weather(city="Paris", days=2), get_time(zone="UTC")]', None,
     [PARIS, TIME]),
    ("pythonic", "<|python_start|>[get_weather(city='Paris', days=2)]<|python_end|>", None,
     [PARIS]),
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]',
     '[get_weather(city=__import__("os").getcwd())]', []),  # not a literal: never run
    ("pythonic", '[get_weather(city="Paris"', '[get_weather(city="Paris"', []),
    ("pythonic", "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", []),
    ("pythonic", "Paris is in France.", "Paris is in France.", []),
    # qwen3_coder: XML-like calls, values typed by the tool's schema
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", None,
     [PARIS]),
    ("qwen3_coder", "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
     "</tool_call>", "I'll check both.", [PARIS, TIME]),
    ("qwen3_coder", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
     "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", []),  # no function
]  # fmt: skip


def auto_plan(parser: str, parallel: bool = True):
    return plan_tools(TOOLS, "auto", parallel, parser)


def answer(content, calls) -> tuple:
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def streamed(parser: str, text: str, step: int) -> tuple:
    """The answer a client puts together from the stream of `text` cut every `step` chars."""
    streamer = ToolCallStreamer(auto_plan(parser))
    content, calls = "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        delta = streamer.delta(piece, finished=i == len(pieces) - 1)
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            assert call["index"] == len(calls) and call["id"] and call["type"] == "function"
            calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return content or None, calls


def test_every_vllm_parser_name_is_offered():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"}


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse(parser, text, content, calls):
    assert answer(*auto_plan(parser).parse(text)) == (content, [(n, a) for n, a in calls])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_stream_adds_up_to_the_same_answer(parser, text, content, calls, step):
    got_content, got_calls = streamed(parser, text, step)
    assert got_calls == [(n, a) for n, a in calls]
    # Content streamed before a call keeps its spacing; stripped, it is the parsed content.
    assert (got_content or "").strip() == (content or "").strip()


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'Hello <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
        ("mistral", 'Hello [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
        ("qwen3_coder", "Hello <tool_call><function=get_time></function></tool_call>"),
        ("llama3_json", 'Hello <|python_tag|>{"name": "get_time", "parameters": {}}'),
    ],
)
def test_content_before_a_call_streams_before_the_answer_ends(parser, text):
    streamer = ToolCallStreamer(auto_plan(parser))
    assert streamer.delta("Hello ", finished=False) == {"content": "Hello "}
    delta = streamer.delta(text[len("Hello ") :], finished=False)
    assert "tool_calls" not in delta and not delta.get("content")  # the call is held back
    delta = streamer.delta("", finished=True)
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_time"]
    assert streamer.made_calls


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_plain_text_streams_at_once_for_formats_that_start_the_answer(parser):
    streamer = ToolCallStreamer(auto_plan(parser))
    assert streamer.delta("The", finished=False) == {"content": "The"}
    assert streamer.delta(" answer", finished=False) == {"content": " answer"}


def test_qwen3_coder_types_values_by_the_schema():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
        '<parameter=scale>\n1.5\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "<parameter=extra>\n{'x': None}\n</parameter>\n</function>\n</tool_call>"
    )
    _, calls = auto_plan("qwen3_coder").parse(text)
    assert json.loads(calls[0].arguments) == {
        "city": "42", "days": 3, "metric": True, "scale": 1.5, "tags": ["a", "b"],
        "extra": {"x": None},
    }  # fmt: skip


def test_qwen3_coder_keeps_a_value_that_does_not_fit_its_type_as_written():
    text = "<tool_call><function=get_weather><parameter=days>two</parameter></function>"
    _, calls = auto_plan("qwen3_coder").parse(text)  # also: the closing tag cut off
    assert json.loads(calls[0].arguments) == {"days": "two"}


def test_calls_to_tools_not_offered_stay_content():
    text = '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]'
    assert answer(*auto_plan("mistral").parse(text)) == (text, [])


def test_mistral_call_ids_are_nine_letters_and_digits():
    _, calls = auto_plan("mistral").parse('[TOOL_CALLS]get_time{"zone": "UTC"}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_mistral_keeps_special_tokens_so_its_marker_reaches_the_parser():
    assert auto_plan("mistral").keeps_special_tokens
    assert not auto_plan("hermes").keeps_special_tokens
    assert not plan_tools(TOOLS, "required", True, "mistral").keeps_special_tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[get_weather(city="Paris", days=2), get_time(zone="UTC")]'
    assert answer(*auto_plan("pythonic", parallel=False).parse(text)) == (None, [PARIS])


def test_pythonic_refuses_deep_nesting_without_failing():
    text = "[f(a=" + "[" * 10000 + "]" * 10000 + ")]"
    assert auto_plan("pythonic").parse(text)[1] == []
