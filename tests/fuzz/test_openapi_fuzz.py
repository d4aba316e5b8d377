"""Schemathesis over the server's own OpenAPI schema: every route and method, fixed seed and
example budget, against a real `pagedllm serve`.

What must hold for every generated request: no 5xx (a 503 from a dead engine included), every
error answered in OpenAI's shape, every stream ended by `[DONE]` with no server error inside;
and afterwards the server is healthy and answers a normal request.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import pytest
import requests
import schemathesis
from entrypoints.server_utils import API_KEY, MODEL, RunningServer
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

# pytest 9.2 gives test items no `_nodeid`, which `schemathesis.pytest.from_fixture(...)
# .parametrize()` rewrites per operation; its own per-operation test builder is used instead.
from schemathesis.pytest.lazy import get_all_tests
from tiers import slow_fixture

# Small limits keep every generated request cheap: n <= MAX_NUM_SEQS, short contexts.
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
# Generated requests that would generate more tokens than this are capped to it (see
# `bounded`); requests asking for more than the context window keep their value (a 400).
MAX_TOKENS_CAP = 2
SEED = 22
# Fuzzing-phase examples per operation; the coverage phase adds its own deterministic cases.
MAX_EXAMPLES = 100
MAX_EXAMPLES_CHEAP = 500
CHEAP_PATHS = ("/tokenize", "/detokenize")
GENERATION = {
    "mode": "all",  # schema-valid bodies and invalid ones
    "deterministic": True,
    "database": "none",
    # A failure is reported as generated: shrinking could take minutes per failure.
    "no-shrink": True,
}
REQUEST_TIMEOUT_S = 60
SERVER_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    # Unknown fields are logged and ignored (the default; the old switch is kept here so
    # launch lines that pass it stay exercised): the rest of each generated body reaches the
    # engine rather than being refused whole.
    "--allow-unknown-fields",
    # LoRA on, with the runtime adapter routes, so their bodies are fuzzed like the others'
    # (no adapter directory exists for what is generated: loads are refused, unloads 404).
    "--enable-lora",
    "--allow-runtime-lora-updating",
    # /v1/responses keeps responses, so previous_response_id and store are fuzzed too.
    "--responses-store-size",
    "4",
]
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


@pytest.fixture(scope="module")
@slow_fixture
def fuzz_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz-server") / "server.log"
    running = RunningServer(SERVER_ARGS, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()[-20000:]


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    # /openapi.json sits behind the API key like every route but /health.
    response = requests.get(fuzz_server.base_url + "/openapi.json", timeout=10)
    assert response.status_code == 401, response.text
    return load_schema(fuzz_server.base_url, fuzz_server.headers)


def load_schema(base_url: str, headers: dict[str, str]):
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "suppress-health-check": ["all"],
            "max-stream-events": 100_000,
            "request-timeout": REQUEST_TIMEOUT_S,
            "headers": headers,
            # Reproducers must show what was sent: no "[Filtered]" for fields named *token*.
            "output": {"sanitization": {"enabled": False}},
            "generation": {**GENERATION, "max-examples": MAX_EXAMPLES},
            # Routes that never generate answer in milliseconds: many more examples there.
            "operations": [
                {
                    "include-path": list(CHEAP_PATHS),
                    "generation": {**GENERATION, "max-examples": MAX_EXAMPLES_CHEAP},
                }
            ],
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                # Nothing learnt from the server's answers: the same seed sends the same cases.
                "fuzzing": {
                    "enabled": True,
                    "error-feedback": {"enabled": False},
                    "extra-data-sources": {"responses": False},
                },
                "stateful": {"enabled": False},
            },
        }
    )
    return schemathesis.openapi.from_url(
        base_url + "/openapi.json", config=config, headers=headers, timeout=10
    )


def openai_error_shape(ctx, response, case) -> None:
    """Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}`."""
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} with a body that is not JSON: {response.content[:300]!r}"
        ) from None
    check_error_object(body, f"{response.status_code} response")
    return None


def check_error_object(body, where: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not OpenAI's shape: {body}"
    error = body["error"]
    assert isinstance(error, dict), f"{where}: error is not an object: {body}"
    missing = {"message", "type", "param", "code"} - set(error)
    assert not missing, f"{where}: error lacks {sorted(missing)}: {body}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: {body}"
    assert isinstance(error["type"], str) and error["type"], f"{where}: {body}"
    assert error["param"] is None or isinstance(error["param"], str), f"{where}: {body}"


def stream_ends_cleanly(ctx, response, case) -> None:
    """A 200 event stream: every event is JSON or `[DONE]`, `[DONE]` comes last, and an error
    event inside it has OpenAI's shape and is not a server error."""
    content_type = ",".join(response.headers.get("content-type", []))
    if response.status_code != 200 or "text/event-stream" not in content_type:
        return None
    assert not response.stream_cut_short, "the stream was not read to its end"
    events = [
        line[len("data: ") :]
        for line in response.content.decode("utf-8").splitlines()
        if line.startswith("data: ")
    ]
    assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {events[-3:]}"
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            check_error_object(payload, "stream error event")
            code = payload["error"]["code"]
            assert not (isinstance(code, int) and code >= 500), f"server error in stream: {event}"
    return None


CHECKS = [not_a_server_error, openai_error_shape, stream_ends_cleanly]


def bounded(case) -> None:
    """Cap how many tokens a generated request may generate (CPU time is the budget here).

    Only values that would be accepted and generate more than the cap are changed; out-of-range
    values (<= 0, beyond the context window, wrong types) reach the server as generated.
    """
    if case.operation.path not in GENERATING_PATHS or not isinstance(case.body, dict):
        return
    body = case.body
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        count = as_count(body.get(key))
        if count is not None and MAX_TOKENS_CAP < count <= MAX_MODEL_LEN:
            body[key] = MAX_TOKENS_CAP
    if case.operation.path == "/v1/responses":
        # Without a limit, a response generates up to the context window.
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS_CAP
        return
    # Without a limit, chat completions generate up to the context window, completions 16.
    if not body.get("max_completion_tokens") and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP


def as_count(value) -> int | None:
    """The integer pydantic's lax mode would read from `value` (150, 150.0, "150"), if any."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value) if isinstance(value, int | float | str) else None
    except ValueError:
        return None
    if number is None or not math.isfinite(number) or number != int(number):
        return None
    return int(number)


def call_and_check(case, server, spent: dict, collect: list | None) -> None:
    """One generated request and its checks; failures go to `collect` when it is given."""
    bounded(case)
    phase = case.meta.phase.name.value if case.meta is not None else "?"
    tally = spent.setdefault(f"{case.operation.label} {phase}", Counter())
    start = time.monotonic()
    try:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        tally[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
    except requests.ConnectionError as error:
        status = server.process.poll()
        raise AssertionError(
            f"the server went away (exit status {status}) on:\n{case.as_curl_command()}\n"
            f"server log tail:\n{server.log()[-5000:]}"
        ) from error
    except (AssertionError, FailureGroup, requests.RequestException) as error:
        if collect is None:
            raise
        collect.append(f"{type(error).__name__}: {error}\n{case.as_curl_command()}")
    finally:
        tally["seconds"] += time.monotonic() - start


def run_fuzz(schema, server, collect: list | None = None, only_path: str | None = None):
    """(failures by operation, a tally of statuses and seconds by operation and phase) over
    every operation of the schema, or only those of `only_path`."""
    failures: dict[str, str] = {}
    spent: dict[str, Counter] = {}
    labels = []
    for result in get_all_tests(
        schema=schema, test_func=call_and_check, settings=None, given_kwargs=None
    ):
        assert isinstance(result, Ok), f"schema error: {result.err()}"
        operation, run_operation = result.ok()
        if only_path is not None and operation.path != only_path:
            continue
        labels.append(operation.label)
        try:
            run_operation(server=server, spent=spent, collect=collect)
        except (AssertionError, FailureGroup) as error:
            failures[operation.label] = str(error)
    assert len(labels) == len(set(labels)) >= (8 if only_path is None else 1), labels
    return failures, spent


def test_no_server_error_on_any_route(fuzz_schema, fuzz_server):
    """Every operation's examples, coverage and fuzzing cases; all failures reported at once."""
    failures, spent = run_fuzz(fuzz_schema, fuzz_server)
    for key, tally in sorted(spent.items()):
        statuses = ", ".join(f"{k}: {tally[k]}" for k in sorted(k for k in tally if k != "seconds"))
        print(f"{key}: {tally['seconds']:.1f} s; statuses {statuses}")
    assert not failures, "\n\n".join(f"== {label}\n{text}" for label, text in failures.items())


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
@pytest.mark.parametrize(
    "path", ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/v1", "/nope"]
)
@pytest.mark.parametrize("authorized", [True, False])
def test_routes_outside_the_schema(fuzz_server, method, path, authorized):
    """FastAPI's own pages and unknown paths: no 5xx, and errors in OpenAI's shape."""
    headers = fuzz_server.headers if authorized else {}
    response = requests.request(method, fuzz_server.base_url + path, headers=headers, timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        check_error_object(response.json(), f"{method} {path}: {response.status_code}")
    if not authorized:
        assert response.status_code == 401


def test_server_healthy_after_fuzzing(fuzz_server):
    """Runs after the fuzzing above (file order): the engine survived, a normal request answers."""
    assert fuzz_server.process.poll() is None, fuzz_server.log()[-5000:]
    assert fuzz_server.get("/health").status_code == 200
    response = fuzz_server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4,
        },
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    response = fuzz_server.post(
        "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    # Nothing the fuzzing sent is left holding KV blocks or a place in the queue.
    assert fuzz_server.metric("kv_cache_usage_perc") == 0.0
    assert fuzz_server.metric("num_requests_running") == 0.0
    assert fuzz_server.metric("num_requests_waiting") == 0.0


def test_embeddings_on_a_pooling_server(pooling_server):
    """The server above generates, so its /v1/embeddings refuses every body that parses;
    a `--runner pooling` server (the run's shared one, tests/pooling_server.py, with as
    short a context) takes them through to the engine."""
    server = pooling_server
    schema = load_schema(server.base_url, server.headers)
    failures, spent = run_fuzz(schema, server, only_path="/v1/embeddings")
    assert not failures, "\n\n".join(f"== {label}\n{text}" for label, text in failures.items())
    assert sum(tally[200] for tally in spent.values()) > 0, spent  # some reached the engine
    response = server.post("/v1/embeddings", {"model": MODEL, "input": "Say hello."})
    assert response.status_code == 200, response.text
    assert server.metric("kv_cache_usage_perc") == 0.0
    assert server.metric("num_requests_running") == 0.0
