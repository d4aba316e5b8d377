"""`pagedllm chat` and `pagedllm complete` against the session server: answers streamed to a
terminal equal the server's greedy answers (the second turn's to the whole conversation),
`/clear` starts over, `/exit` and end of input quit, and a server that cannot be reached or
refuses is one line on stderr, never a traceback."""

from __future__ import annotations

import os
import sys

import pexpect
from process_guard import dies_with_us
from server_utils import API_KEY

from pagedllm.entrypoints.cli import main
from pagedllm.utils import free_port

MAX_TOKENS = 16
FIRST = "What is the capital of France?"
SECOND = "And of Germany?"
PROMPT = "\r\n> "  # the end of an answer, then the next prompt


def spawn(server, command: str) -> pexpect.spawn:
    args = ["-m", "pagedllm.entrypoints.cli", command, "--url", server.base_url + "/v1"]
    args += ["--api-key", API_KEY, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    env = {**os.environ, "PAGEDLLM_API_KEY": "", "OPENAI_API_KEY": ""}
    return pexpect.spawn(
        sys.executable, args, encoding="utf-8", timeout=180, env=env, dimensions=(50, 1000),
        preexec_fn=dies_with_us(),
    )  # fmt: skip


def answer_to(child: pexpect.spawn, line: str) -> str:
    """Send `line`; the answer the client printed (the terminal echoes the line first)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    echoed, _, answer = child.before.partition("\r\n")
    assert echoed == line
    return answer.replace("\r\n", "\n")


def greedy_chat(client, messages: list[dict]) -> str:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=MAX_TOKENS
    )
    return response.choices[0].message.content


def test_chat_two_turns_clear_and_exit(server, client):
    child = spawn(server, "chat")
    child.expect_exact("/exit quits)")
    child.expect_exact("> ")
    first = answer_to(child, FIRST)
    assert first == greedy_chat(client, [{"role": "user", "content": FIRST}])
    second = answer_to(child, SECOND)
    history = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first},
        {"role": "user", "content": SECOND},
    ]
    assert second == greedy_chat(client, history)
    assert second != greedy_chat(client, [{"role": "user", "content": SECOND}])

    child.sendline("/clear")
    child.expect_exact("(conversation cleared)" + PROMPT)
    alone = answer_to(child, SECOND)
    assert alone == greedy_chat(client, [{"role": "user", "content": SECOND}])
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_complete_streams_each_line_and_stops_at_end_of_input(server, client):
    child = spawn(server, "complete")
    child.expect_exact("> ")
    prompts = ["The capital of France is", "One, two, three,"]
    for prompt in prompts:
        expected = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS
        )
        assert answer_to(child, prompt) == expected.choices[0].text
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_quick_chat_with_a_system_prompt(server, client, capsys):
    argv = ["chat", "--url", server.base_url + "/v1", "--api-key", API_KEY]
    argv += ["--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
    argv += ["--system-prompt", "You answer in French.", "-q", FIRST]
    assert main(argv) == 0
    expected = greedy_chat(
        client,
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": FIRST},
        ],
    )
    assert capsys.readouterr().out == expected + "\n"


def test_unreachable_or_refusing_server_is_one_line(server, capsys):
    unreachable = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["chat", "--url", unreachable, "-q", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach the server at") and "Traceback" not in err

    wrong_key = ["--url", server.base_url + "/v1", "--api-key", "wrong"]
    assert main(["complete", *wrong_key, "-q", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the server answered 401: Unauthorized") and err.count("\n") == 1

    # An error the server answers for one request names the field.
    refused = ["--url", server.base_url + "/v1", "--api-key", API_KEY, "--temperature", "-1"]
    assert main(["chat", *refused, "-q", "hi"]) == 1
    err = capsys.readouterr().err
    assert "the server answered 400" in err and "(param: temperature)" in err
