"""Tenants on a running server: several keys (a flag and a keys file), 401 for a wrong one,
per-tenant limits answered with 429 + Retry-After, SIGHUP reloading the keys file, a key in
a query string kept out of the access log, prefix caches kept apart, a `tenant` metric label.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest
from process_guard import dies_with_us
from server_utils import RunningServer, free_port
from tiers import slow_fixture

FLAG_KEY = "sk-flag-key-000"
ADMIN_KEY = "sk-admin-key-999"  # /metrics across tenants (test_tenant_admin.py has the rest)
KEYS = {
    "alice": "sk-alice-111",
    "bob": "sk-bob-222",
    "carol": "sk-carol-333",  # the default limit: 2 requests a minute
    "dave": "sk-dave-444",
    "erin": "sk-erin-555",
    "gone": "sk-gone-666",  # removed by the reload test
}
NEW_KEY = "sk-newbie-777"  # added by the reload test
UNLIMITED = "max_requests_per_minute=none"
KEYS_FILE = f"""# name key [limits]
alice {KEYS["alice"]} {UNLIMITED}
bob   {KEYS["bob"]}   {UNLIMITED}
carol {KEYS["carol"]}
dave  {KEYS["dave"]}  {UNLIMITED} max_concurrent_requests=1
erin  {KEYS["erin"]}  {UNLIMITED} max_tokens_per_minute=50
"""
WAIT_S = 60.0


class AccessLoggedServer(RunningServer):
    """`RunningServer` with uvicorn's access log on (these tests read it)."""

    def __init__(self, args: list[str], log_path, api_key: str) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--api-key", api_key]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PAGEDLLM_DEBUG": "1"}
        env.pop("PAGEDLLM_API_KEY", None)
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=dies_with_us()
        )
        self._wait_healthy()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "keys.txt"
    path.write_text(KEYS_FILE + f"gone {KEYS['gone']} {UNLIMITED}\n")
    return path


@pytest.fixture(scope="module")
@slow_fixture
def server(tiny_llama, keys_file, tmp_path_factory):
    log = tmp_path_factory.mktemp("tenants-log") / "server.log"
    args = [str(tiny_llama), "--api-keys-file", str(keys_file)]
    args += ["--tenant-max-requests-per-minute", "2", "--admin-api-key", ADMIN_KEY]
    running = AccessLoggedServer(args, log, api_key=FLAG_KEY)
    running.api_key = ADMIN_KEY  # server.get and server.metric read every tenant's series
    yield running
    assert running.stop() == 0, running.log()
    for key in [FLAG_KEY, ADMIN_KEY, NEW_KEY, *KEYS.values()]:
        assert key not in running.log(), "a key reached the log"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server, key: str, **body) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(
        server.base_url + "/v1/completions", json=body, headers=auth(key), timeout=120
    )


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def assert_rate_limited(response: httpx.Response, limit: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert limit in error["message"]
    assert int(response.headers["Retry-After"]) >= 1
    assert response.headers["X-Request-Id"]


def test_each_key_is_a_tenant_and_a_wrong_key_gets_401(server):
    assert complete(server, KEYS["alice"]).status_code == 200
    assert complete(server, FLAG_KEY).status_code == 200  # --api-key goes on working
    for headers in ({}, auth("sk-alice-11"), auth(KEYS["alice"] + "1"), {"Authorization": "x"}):
        response = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "Hi"}, headers=headers
        )
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_requests_per_minute_limit(server):
    assert complete(server, KEYS["carol"]).status_code == 200
    assert complete(server, KEYS["carol"]).status_code == 200
    refused = complete(server, KEYS["carol"])
    assert_rate_limited(refused, "requests per minute")
    assert int(refused.headers["Retry-After"]) <= 30  # one request a 30 s
    assert complete(server, KEYS["alice"]).status_code == 200  # other tenants go on
    # limits count generation requests only
    assert httpx.get(server.base_url + "/v1/models", headers=auth(KEYS["carol"])).status_code == 200


def test_tokens_per_minute_limit(server):
    first = complete(server, KEYS["erin"], max_tokens=100, ignore_eos=True)
    assert first.status_code == 200  # admitted: the budget was not overdrawn yet
    assert first.json()["usage"]["completion_tokens"] == 100
    refused = complete(server, KEYS["erin"])
    assert_rate_limited(refused, "tokens per minute")
    assert int(refused.headers["Retry-After"]) > 30  # ~50 tokens of debt at 50 a minute


def test_concurrent_requests_limit(server):
    # ~1 MB of events the client does not read: the server's writes stall (uvicorn's flow
    # control), so the first request stays in flight however fast the model is.
    body = {"prompt": "Once", "max_tokens": 1000, "n": 6, "ignore_eos": True, "stream": True}
    url = server.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=auth(KEYS["dave"]), timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # held: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        refused = complete(server, KEYS["dave"])
        assert_rate_limited(refused, "max_concurrent_requests")
        assert refused.headers["Retry-After"] == "1"
        assert complete(server, KEYS["alice"]).status_code == 200
    # The client left: the server notices, aborts the stream and frees the slot.
    wait_for(lambda: complete(server, KEYS["dave"]).status_code == 200, "the slot to free")
    wait_for(lambda: server.metric("num_requests_running") == 0, "the abort")


def test_prefix_cache_is_not_shared_between_tenants(server):
    prompt = random.Random(22).choices(range(3, 400), k=96)  # six blocks of 16

    def hits_after(key: str) -> float:
        assert complete(server, key, prompt=prompt, max_tokens=1).status_code == 200
        return server.metric("prefix_cache_hits_total")

    before = server.metric("prefix_cache_hits_total")
    first = hits_after(KEYS["alice"])
    assert first == before
    second = hits_after(KEYS["alice"])
    assert second >= before + 64  # alice's own prefix is cached
    other = hits_after(KEYS["bob"])
    assert other == second  # bob cannot reach (or time) alice's cached prefix
    assert hits_after(KEYS["bob"]) > other  # but has his own


def test_request_ids_are_scoped_per_tenant(server):
    # alice's stream stays in flight (as dave's above) while the others send her id.
    url = server.base_url + "/v1/completions"
    body = {"prompt": "Once", "max_tokens": 1000, "n": 6, "ignore_eos": True, "stream": True}
    body["request_id"] = "shared-1"
    with httpx.stream("POST", url, json=body, headers=auth(KEYS["alice"]), timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # held: dropping the iterator would close the stream
        assert next(lines).startswith("data: ")
        by_body = complete(server, KEYS["bob"], request_id="shared-1")
        by_header = httpx.post(
            url,
            json={"prompt": "Hello", "max_tokens": 2},
            headers={**auth(KEYS["bob"]), "X-Request-Id": "shared-1"},
            timeout=120,
        )
        for response in (by_body, by_header):  # another tenant's id: free, echoed unchanged
            assert response.status_code == 200, response.text
            assert response.headers["X-Request-Id"] == response.json()["id"] == "shared-1"
        duplicate = complete(server, KEYS["alice"], request_id="shared-1")
        assert duplicate.status_code == 400, duplicate.text
        error = duplicate.json()["error"]
        assert error["message"] == "request_id 'shared-1' is already running"
        assert error["param"] == "request_id"


def test_metrics_carry_the_tenant_label(server):
    text = server.get("/metrics").text
    tenants = set(re.findall(r'tenant="([^"]*)"', text))
    assert {"alice", "bob", "key-1"} <= tenants
    assert tenants <= {"key-1", "admin", *KEYS}  # bounded by the configured tenants
    assert re.search(r'pagedllm:generation_tokens_total\{[^}]*tenant="erin"[^}]*\} 100\.0', text)
    assert re.search(r'pagedllm:time_to_first_token_seconds_count\{[^}]*tenant="bob"', text)
    # dave's stream (`vllm:` has an abort series from the start, at 0).
    assert re.search(r'pagedllm:request_success_total\{[^}]*finished_reason="abort"', text)
    for key in [FLAG_KEY, *KEYS.values()]:
        assert key not in text


def test_a_key_in_the_query_string_stays_out_of_the_access_log(server):
    url = f"{server.base_url}/v1/models?api_key={KEYS['alice']}&x=1"
    assert httpx.get(url, headers=auth(KEYS["alice"])).status_code == 200
    wait_for(lambda: "GET /v1/models?api_key=[REDACTED]&x=1" in server.log(), "the log line")
    assert KEYS["alice"] not in server.log()


def test_sighup_reloads_the_keys_file(server, keys_file):
    def status(key: str) -> int:
        return httpx.get(server.base_url + "/v1/models", headers=auth(key)).status_code

    assert status(KEYS["gone"]) == 200 and status(NEW_KEY) == 401
    keys_file.write_text(KEYS_FILE + f"newbie {NEW_KEY}\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: status(NEW_KEY) == 200, "the new key")
    assert status(KEYS["gone"]) == 401
    assert status(FLAG_KEY) == 200  # --api-key keys stay
    assert "added: newbie; removed: gone" in server.log()

    keys_file.write_text(KEYS_FILE + f"newbie {NEW_KEY}\nnewbie sk-other-888\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "Keeping the old API keys" in server.log(), "the reload error")
    assert "'newbie' is used twice" in server.log()
    assert status(NEW_KEY) == 200 and status("sk-other-888") == 401
    assert server.get("/health").status_code == 200
