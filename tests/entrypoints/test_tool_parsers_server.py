"""Tool-call and reasoning parsers end to end: `pagedllm serve` on a tiny model with each
format's own chat template (`chat_templates/`), `--tool-call-parser` and `--reasoning-parser`
as a vLLM user starts them. A random model writes no calls, so a guided regex makes it write
the format's text; the answers, whole and streamed, must come back as vLLM returns them:
`tool_calls`, `reasoning_content`, and the content around them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest
from server_utils import RunningServer

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def start(tiny_llama, tmp_path_factory, template: str, *flags: str) -> RunningServer:
    log = tmp_path_factory.mktemp(template) / "server.log"
    args = [str(tiny_llama), "--chat-template", str(TEMPLATES / f"{template}.jinja")]
    args += ["--enable-auto-tool-choice", *flags]
    return RunningServer(args, log)


@pytest.fixture(scope="module")
def qwen3_coder(tiny_llama, tmp_path_factory):
    flags = ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"]
    server = start(tiny_llama, tmp_path_factory, "qwen3_coder", *flags)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def llama3_json(tiny_llama, tmp_path_factory):
    server = start(tiny_llama, tmp_path_factory, "llama3_json", "--tool-call-parser", "llama3_json")
    yield server
    assert server.stop() == 0, server.log()


def forced(answer: str, **extra) -> dict:
    """A chat request whose answer is exactly `answer` (a guided regex of its literal text)."""
    pattern = "".join("\\" + c if c in ".^$*+?{}[]\\|()" else c for c in answer)
    return {
        "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": len(answer) + 8,
        "guided_regex": pattern, **extra,
    }  # fmt: skip


def whole(server: RunningServer, body: dict) -> dict:
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
             message["tool_calls"]]  # fmt: skip
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(ids)
    return {
        "reasoning": message.get("reasoning_content"), "content": message["content"],
        "calls": calls, "finish": choice["finish_reason"],
    }  # fmt: skip


def streamed(server: RunningServer, body: dict) -> dict:
    """The same fields put together from the stream's deltas, as a client does."""
    reasoning, content, calls, finish = "", "", {}, None
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
        timeout=120,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    name, arguments = calls.get(call["index"], ("", ""))
                    function = call.get("function", {})
                    name += function.get("name") or ""
                    calls[call["index"]] = (name, arguments + (function.get("arguments") or ""))
                finish = choice["finish_reason"] or finish
    return {
        "reasoning": reasoning or None, "content": content.strip() or None,
        "calls": [(name, json.loads(arguments)) for name, arguments in calls.values()],
        "finish": finish,
    }  # fmt: skip


QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize("read", [whole, streamed])
def test_qwen3_coder_call_after_thinking(qwen3_coder, read):
    answer = f"<think>\nThe user wants weather.\n</think>\n\nChecking.\n{QWEN3_CODER_CALL}"
    got = read(qwen3_coder, forced(answer))
    assert got["reasoning"] == "\nThe user wants weather.\n"
    assert got["content"].strip() == "Checking."
    assert got["calls"] == [("get_weather", {"city": "Paris", "days": 2})]
    assert got["finish"] == "tool_calls"


@pytest.mark.parametrize("read", [whole, streamed])
def test_qwen3_without_thinking_is_all_content_and_a_bad_call_stays_content(qwen3_coder, read):
    answer = "Sunny.\n<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    body = forced(answer, chat_template_kwargs={"enable_thinking": False})
    got = read(qwen3_coder, body)
    assert got == {"reasoning": None, "content": answer, "calls": [], "finish": "stop"}


@pytest.mark.parametrize("read", [whole, streamed])
def test_llama3_json_calls(llama3_json, read):
    answer = (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Lyon", "days": 3}}'
    )
    got = read(llama3_json, forced(answer))
    assert got["calls"] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "days": 3}),
    ]  # fmt: skip
    assert got["content"] is None and got["reasoning"] is None
    assert got["finish"] == "tool_calls"


@pytest.mark.parametrize("read", [whole, streamed])
def test_llama3_json_plain_answer_is_content(llama3_json, read):
    got = read(llama3_json, forced("It is sunny in Paris."))
    assert got == {
        "reasoning": None, "content": "It is sunny in Paris.", "calls": [], "finish": "stop",
    }  # fmt: skip


def test_llama3_template_renders_the_tools_and_a_call_round_trip(llama3_json):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "15 C, sunny"},
    ]
    body = {**forced("It is 15 C and sunny."), "messages": messages}
    assert whole(llama3_json, body)["content"] == "It is 15 C and sunny."


def test_a_parser_flag_vllm_does_not_have_is_refused(tiny_llama, tmp_path):
    with pytest.raises(RuntimeError, match="tool-call-parser"):
        RunningServer(
            [str(tiny_llama), "--enable-auto-tool-choice", "--tool-call-parser", "nope"],
            tmp_path / "log",
        )
