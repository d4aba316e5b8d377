"""`--audit-log` on a running server with two tenants: a line per request with its tenant,
id, model, tokens (equal to the response's usage), status and times; refusals and a key
reload logged; no prompt and no key in the file; one tenant's lines by `pagedllm audit-log`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx2 as httpx
import pytest
from server_utils import RunningServer, wait_until
from tiers import slow_fixture

KEYS = {"alice": "sk-audit-alice-1", "bob": "sk-audit-bob-2"}
OPERATOR_KEY = "sk-audit-operator-0"  # --api-key: a tenant of its own
PROMPT = "The secret prompt text 7391"


@pytest.fixture(scope="module")
@slow_fixture
def server(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit")
    keys_file = folder / "keys.txt"
    keys_file.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    audit = folder / "audit.jsonl"
    args = [str(tiny_llama), "--api-keys-file", str(keys_file), "--audit-log", str(audit)]
    running = RunningServer(args, folder / "server.log", api_key=OPERATOR_KEY)
    running.audit_path = audit
    yield running
    assert running.stop() == 0, running.log()


def lines_of(server) -> list[dict]:
    return [json.loads(line) for line in server.audit_path.read_text().splitlines()]


def post(server, path: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def as_tenant(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def test_each_request_gets_a_line_with_its_tenant_tokens_and_outcome(server):
    model = server_model(server)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    alice = post(server, "/v1/completions", body, as_tenant("alice"))
    assert alice.status_code == 200, alice.text
    chat = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": PROMPT}]}
    bob = post(server, "/v1/chat/completions", chat, as_tenant("bob"))
    assert bob.status_code == 200, bob.text
    wrong_key = post(server, "/v1/completions", body, {"Authorization": "Bearer nope"})
    assert wrong_key.status_code == 401
    bad = post(server, "/v1/completions", {**body, "max_tokens": -1}, as_tenant("bob"))
    assert bad.status_code == 400
    expected = {
        ("/v1/completions", "alice", 200),
        ("/v1/chat/completions", "bob", 200),
        ("/v1/completions", None, 401),
        ("/v1/completions", "bob", 400),
    }
    # A line is written after its response's last byte, by the log's own thread.
    wait_until(lambda: expected <= set(_by_outcome(server)), "the four requests' lines")
    by_path_and_tenant = _by_outcome(server)
    completion = by_path_and_tenant[("/v1/completions", "alice", 200)]
    usage = alice.json()["usage"]
    assert completion["prompt_tokens"] == usage["prompt_tokens"]
    assert completion["completion_tokens"] == usage["completion_tokens"]
    assert completion["request_id"] == alice.json()["id"]
    assert completion["model"] == server_model(server)
    assert completion["finish_reasons"] == ["length"]
    assert completion["queue_time_s"] is not None and completion["total_time_s"] > 0
    chat = by_path_and_tenant[("/v1/chat/completions", "bob", 200)]
    assert chat["completion_tokens"] == bob.json()["usage"]["completion_tokens"]
    assert by_path_and_tenant[("/v1/completions", None, 401)]["prompt_tokens"] == 0
    assert ("/v1/completions", "bob", 400) in by_path_and_tenant
    text = server.audit_path.read_text()
    assert PROMPT not in text, "a prompt reached the audit log"
    for key in [OPERATOR_KEY, *KEYS.values()]:
        assert key not in text, "a key reached the audit log"


def test_a_key_reload_is_an_admin_line(server):
    os.kill(server.process.pid, signal.SIGHUP)
    wait_until(
        lambda: any(line.get("action") == "reload_api_keys" for line in lines_of(server)),
        "the reload's line",
    )
    reload = next(line for line in lines_of(server) if line.get("action") == "reload_api_keys")
    assert reload["event"] == "admin" and reload["ok"] is True and reload["num_tenants"] == 3


def test_one_tenants_lines_are_printed_by_the_cli(server):
    httpx.get(server.base_url + "/v1/models", headers=as_tenant("bob"), timeout=60)
    wait_until(lambda: any(line["tenant"] == "bob" for line in _requests(server)), "bob's")
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "audit-log",
               str(server.audit_path), "--tenant", "bob"]  # fmt: skip
    printed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    tenants = {json.loads(line)["tenant"] for line in printed.stdout.splitlines()}
    assert tenants == {"bob"}


def _by_outcome(server) -> dict[tuple, dict]:
    return {(line["path"], line["tenant"], line["status"]): line for line in _requests(server)}


def _requests(server) -> list[dict]:
    return [line for line in lines_of(server) if line["event"] == "request"]


def server_model(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]
