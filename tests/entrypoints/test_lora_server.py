"""LoRA over HTTP (vLLM's surface): `--lora-modules`, adapters by name in `model`, their
cards in /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter behind
`--allow-runtime-lora-updating` and the API key, and `pagedllm:lora_requests_info`.

One server on a tiny Llama serves every end-to-end case (module-scoped); the flag parser,
the registry, the app factory and the metric are tested without one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from lora_utils import make_peft_adapter
from process_guard import dies_with_us
from server_utils import API_KEY, RunningServer
from tiers import slow_fixture

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.lora_registry import (
    LoRAModulePath,
    LoRARegistry,
    parse_lora_module,
)
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.serve_cli import _lora_overrides
from pagedllm.lora.peft import LoRAAdapterError
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import EngineStats

BASE = "tiny-base"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
MAX_TOKENS = 12
MAX_LORA_RANK = 16
# Large enough weights that an adapter's greedy text differs from the base model's.
STD = 0.1


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    paths = {
        "sql": make_peft_adapter(tiny_llama, root / "sql", seed=1, std=STD),
        "chat": make_peft_adapter(tiny_llama, root / "chat", seed=2, rank=4, std=STD),
    }
    # A rank the server refuses (above --max-lora-rank), with everything else in place.
    too_large = make_peft_adapter(tiny_llama, root / "rank32", seed=3, rank=32, alpha=32)
    paths["rank32"] = too_large
    return paths


@pytest.fixture(scope="module")
def offline_texts(tiny_llama, adapters) -> dict[str | None, str]:
    """The offline engine's greedy text for the prompt: the base model's and each adapter's."""
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts: dict[str | None, str] = {}
    for index, name in enumerate([None, "sql", "chat"]):
        lora = None if name is None else LoRARequest(name, index, str(adapters[name]))
        [output] = llm.generate(
            {"prompt_token_ids": PROMPT}, params, use_tqdm=False, lora_request=lora
        )
        texts[name] = output.outputs[0].text
    return texts


@pytest.fixture(scope="module")
@slow_fixture
def lora_server(tiny_llama, adapters, tmp_path_factory):
    json_module = {"name": "sql-json", "path": str(adapters["sql"]), "base_model_name": "llama"}
    args = [
        str(tiny_llama),
        "--served-model-name",
        BASE,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--lora-modules",
        f"sql={adapters['sql']}",
        json.dumps(json_module),
        "--allow-runtime-lora-updating",
        "--strict-request-fields",  # an unknown field of a load request is a 400
    ]
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    running = RunningServer(args, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()


def completion_body(model: str, **extra) -> dict:
    """A greedy completion of PROMPT by `model` (an adapter's name or the base model's)."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {"model": model, **body, **extra}


def completion(server: RunningServer, model: str, **extra):
    return server.post("/v1/completions", completion_body(model, **extra))


@contextlib.contextmanager
def streamed_completion(server: RunningServer, model: str, **extra) -> Iterator[Iterator[dict]]:
    """A streamed greedy completion's chunks as they arrive; leaving closes the connection
    (which aborts the request if it still runs)."""
    body = completion_body(model, stream=True, **extra)
    url = server.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=server.headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = (line[len("data: ") :] for line in response.iter_lines() if line)
        yield (json.loads(event) for event in events if event != "[DONE]")


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def model_ids(server: RunningServer) -> list[str]:
    return [card["id"] for card in server.get("/v1/models").json()["data"]]


# ---- one server, end to end ------------------------------------------------------------------
def test_models_list_adapters_with_root_and_parent(lora_server, adapters):
    cards = {card["id"]: card for card in lora_server.get("/v1/models").json()["data"]}
    assert list(cards)[:1] == [BASE] and cards[BASE]["parent"] is None
    assert cards["sql"]["root"] == str(adapters["sql"])
    assert cards["sql"]["parent"] == BASE
    assert cards["sql-json"]["parent"] == "llama"
    assert cards["sql"]["object"] == "model"


def test_adapter_by_name_matches_offline_and_differs_from_base(lora_server, offline_texts):
    assert offline_texts["sql"] != offline_texts[None]
    base = completion(lora_server, BASE)
    assert text_of(base) == offline_texts[None]
    response = completion(lora_server, "sql")
    assert text_of(response) == offline_texts["sql"]
    assert response.json()["model"] == "sql"
    # The same adapter under its second name (its own id: KV never shared, same weights).
    assert text_of(completion(lora_server, "sql-json")) == offline_texts["sql"]
    assert base.json()["model"] == BASE
    chat = lora_server.post(
        "/v1/chat/completions",
        {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "sql"


def test_streamed_adapter_completion_names_the_adapter(lora_server, offline_texts):
    response = completion(lora_server, "sql", stream=True)
    assert response.status_code == 200, response.text
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["model"] for chunk in chunks} == {"sql"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline_texts["sql"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(lora_server, path):
    body = {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 2}
    if path.endswith("chat/completions"):
        body = {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]}
    response = lora_server.post(path, body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["message"] == "The model `no-such-adapter` does not exist."
    assert error["type"] == "NotFoundError" and error["param"] == "model"


def test_load_use_and_unload_at_runtime(lora_server, adapters, offline_texts):
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    loaded = lora_server.post("/v1/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'chat' added successfully."
    assert "chat" in model_ids(lora_server)
    assert text_of(completion(lora_server, "chat")) == offline_texts["chat"]
    # The name is taken, whatever the path.
    again = lora_server.post("/v1/load_lora_adapter", {**body, "lora_path": str(adapters["sql"])})
    assert again.status_code == 400, again.text
    assert "already been loaded" in again.json()["error"]["message"]
    assert "Loaded LoRA adapter 'chat'" in lora_server.log()  # with its load time
    # An id that is not the adapter's refuses the unload.
    wrong_id = lora_server.post(
        "/v1/unload_lora_adapter", {"lora_name": "chat", "lora_int_id": 10**9}
    )
    assert wrong_id.status_code == 404, wrong_id.text
    unloaded = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'chat' removed successfully."
    assert "chat" not in model_ids(lora_server)
    assert completion(lora_server, "chat").status_code == 404
    second = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert second.status_code == 404, second.text
    assert second.json()["error"]["type"] == "NotFoundError"
    # Loaded again (a new id): served again, from its files.
    assert lora_server.post("/v1/load_lora_adapter", body).status_code == 200
    assert text_of(completion(lora_server, "chat")) == offline_texts["chat"]
    assert lora_server.post("/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200


def test_unload_leaves_running_requests_alone(lora_server, adapters):
    """A request that already runs with an adapter finishes when the adapter is unloaded."""
    body = {"lora_name": "sql-2", "lora_path": str(adapters["sql"])}
    assert lora_server.post("/v1/load_lora_adapter", body).status_code == 200
    usage = {"include_usage": True}
    with streamed_completion(lora_server, "sql-2", max_tokens=200, stream_options=usage) as events:
        chunks = [next(events)]  # the request runs
        unloaded = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "sql-2"})
        assert unloaded.status_code == 200, unloaded.text
        chunks += events
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert completion(lora_server, "sql-2").status_code == 404


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        # Outside the root (the --lora-modules directories): the one answer for every path.
        ({"lora_name": "gone", "lora_path": "/no/such/adapter"}, "lora_path", "no LoRA adapter"),
        ({"lora_name": "x"}, "lora_path", "Field required"),
        ({"lora_path": "/tmp"}, "lora_name", "Field required"),
        ({"lora_name": 5, "lora_path": "/tmp"}, "lora_name", "valid string"),
        ({"lora_name": "x", "lora_path": ["/tmp"]}, "lora_path", "valid string"),
        ({"lora_name": "", "lora_path": "/tmp"}, "lora_name", "non-empty"),
        # lora_requests_info lists running adapters joined by commas.
        ({"lora_name": "a,b", "lora_path": "/tmp"}, "lora_name", "may not contain ','"),
        ({"lora_name": BASE, "lora_path": "/tmp"}, "lora_name", "base model"),
        ({"lora_name": "x", "lora_path": "/tmp", "extra": 1}, "extra", "unknown field"),
    ],
)
def test_bad_load_requests_are_400_naming_the_field(lora_server, body, param, words):
    response = lora_server.post("/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert model_ids(lora_server)[1:] == ["sql", "sql-json"]


def test_adapter_above_max_lora_rank_is_refused(lora_server, adapters):
    body = {"lora_name": "big", "lora_path": str(adapters["rank32"])}
    response = lora_server.post("/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "32" in message and str(MAX_LORA_RANK) in message, message
    assert "big" not in model_ids(lora_server)


def test_bad_unload_requests(lora_server):
    missing = lora_server.post("/v1/unload_lora_adapter", {})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_name"
    wrong = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "sql", "lora_int_id": "x"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "lora_int_id"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/models"),
    ],
)
def test_lora_routes_need_the_api_key(lora_server, adapters, method, path):
    body = {"lora_name": "sneaky", "lora_path": str(adapters["chat"])}
    response = httpx.request(method, lora_server.base_url + path, json=body, timeout=30)
    assert response.status_code == 401, response.text
    assert "sneaky" not in model_ids(lora_server)


def test_lora_requests_info_metric(lora_server):
    """While an adapter's request runs, the gauge's running label names it; max_lora is set."""
    with streamed_completion(lora_server, "sql", max_tokens=1000) as events:
        next(events)  # the request runs: every step's stats now count it
        lines = lora_server.get("/metrics").text.splitlines()
    seen = [line for line in lines if line.startswith("pagedllm:lora_requests_info{")]
    assert len(seen) == 1, seen  # one series per engine: the current one
    assert 'running_lora_adapters="sql"' in seen[0] and 'max_lora="2"' in seen[0], seen
    assert float(seen[0].rsplit(" ", 1)[1]) > 1e9  # a Unix time


# ---- without a server ------------------------------------------------------------------------
def test_parse_lora_module_forms():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module("sql=/a=b") == LoRAModulePath("sql", "/a=b")
    module = parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "llama"}')
    assert module == LoRAModulePath("sql", "/a", "llama")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("sql", "expected name=path"),
        ("=/a", "non-empty"),
        ("sql=", "non-empty"),
        ("{not json", "not valid JSON"),
        ('{"name": "sql"}', "path missing"),
        ('{"name": "sql", "path": "/a", "rank": 8}', "unknown key(s) rank"),
        ('{"name": 3, "path": "/a"}', "non-empty string"),
        ("a,b=/a", "may not contain ','"),
        ('{"name": "sql", "path": "/a", "base_model_name": ""}', "base_model_name"),
    ],
)
def test_parse_lora_module_refuses_bad_values(value, words):
    with pytest.raises(ValueError, match="lora_modules") as error:
        parse_lora_module(value)
    assert words in str(error.value)


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


def test_lora_serve_flags(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    args = serve_args("--enable-lora", "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z")
    overrides = _lora_overrides(args)
    assert [m.name for m in overrides["lora_modules"]] == ["a", "b", "c"]
    assert overrides["allow_runtime_lora_updating"] is False
    assert _lora_overrides(serve_args("--enable-lora", "--allow-runtime-lora-updating"))[
        "allow_runtime_lora_updating"
    ]
    for value, expected in [("1", True), ("true", True), ("TRUE", True), ("0", False)]:
        monkeypatch.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert _lora_overrides(serve_args("--enable-lora"))["allow_runtime_lora_updating"] is (
            expected
        )
        # The environment may be set for every server: without LoRA it is off, no error.
        assert _lora_overrides(serve_args())["allow_runtime_lora_updating"] is False
    flag_off = serve_args("--enable-lora", "--no-allow-runtime-lora-updating")
    assert _lora_overrides(flag_off)["allow_runtime_lora_updating"] is False


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "nameonly"], "expected name=path"),
    ],
)
def test_bad_lora_serve_flags_fail_before_the_model_loads(flags, words, capsys):
    assert main(["serve", "no-such-model-dir", *flags]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.slow  # `pagedllm serve` in a process
def test_bad_lora_module_stops_the_server_with_the_reason(tiny_llama, adapters):
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama)]
    command += ["--enable-lora", "--max-lora-rank", "16", "--port", "0"]
    command += ["--lora-modules", f"big={adapters['rank32']}"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, preexec_fn=dies_with_us()
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: lora_modules: LoRA adapter 'big': rank r=32 is larger" in result.stderr


def test_server_config_refuses_clashing_adapter_names():
    with pytest.raises(ValueError, match="more than once"):
        ServerConfig(("m",), lora_modules=(LoRAModulePath("a", "/x"), LoRAModulePath("a", "/y")))
    with pytest.raises(ValueError, match="base model's served name"):
        ServerConfig(("m",), lora_modules=(LoRAModulePath("m", "/x"),))


def test_registry_ids_are_never_reused_and_checks_run_off_the_loop():
    threads = []

    def check(lora_request: LoRARequest) -> None:
        threads.append(threading.current_thread())
        if "broken" in lora_request.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: broken")

    registry = LoRARegistry(("base",), check)
    registry.add_static((LoRAModulePath("a", "/a"),))

    async def scenario() -> list[int]:
        ids = [registry.resolve("a").lora_int_id]
        ids.append((await registry.load("b", "/b")).lora_int_id)
        registry.unload("b")
        with pytest.raises(OpenAIError) as broken:
            await registry.load("b", "/broken")
        assert broken.value.status == 400 and "broken" in broken.value.message
        ids.append((await registry.load("b", "/b")).lora_int_id)
        # Two loads of one name at once: the second is refused while the first is checked.
        first = asyncio.ensure_future(registry.load("c", "/c"))
        await asyncio.sleep(0)
        with pytest.raises(OpenAIError, match="already been loaded"):
            await registry.load("c", "/c")
        ids.append((await first).lora_int_id)
        return ids

    ids = asyncio.run(scenario())
    assert ids == sorted(ids) and len(set(ids)) == 4 and ids[2] > ids[1] + 1
    assert threads[0] is threading.main_thread()  # the static one, at start-up
    assert all(t is not threading.main_thread() for t in threads[1:])
    assert registry.resolve(None) is None and registry.resolve("base") is None
    with pytest.raises(OpenAIError) as missing:
        registry.resolve("z")
    assert missing.value.status == 404
    with pytest.raises(ValueError, match="lora_modules: LoRA adapter 'x': broken"):
        registry.add_static((LoRAModulePath("x", "/broken"),))


def test_a_runtime_load_trims_the_heap_after_its_check(monkeypatch):
    # The check reads the adapter's weights in a worker thread: the heap is trimmed there,
    # after it, whether the adapter was served or refused (pagedllm.heap says why).
    events = []

    def check(lora_request: LoRARequest) -> None:
        events.append(("check", lora_request.lora_path))
        if "broken" in lora_request.lora_path:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: broken")

    def trim() -> bool:
        events.append(("trim", threading.current_thread() is threading.main_thread()))
        return True

    monkeypatch.setattr("pagedllm.entrypoints.openai.lora_registry.trim_heap", trim)
    registry = LoRARegistry(("base",), check)
    registry.add_static((LoRAModulePath("a", "/a"),))
    assert events == [("check", "/a")]  # start-up: no runtime load, no trim

    async def scenario() -> None:
        await registry.load("b", "/b")
        with pytest.raises(OpenAIError):
            await registry.load("c", "/broken")

    asyncio.run(scenario())
    assert events[1:] == [("check", "/b"), ("trim", False), ("check", "/broken"), ("trim", False)]


def app_routes(tiny_llama, **config) -> set[str]:
    """The routes `build_app` makes for a LoRA engine (no core process: the app only)."""
    from pagedllm.core.engine_config import load_engine_config
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.frontend.processor import InputProcessor

    _, tokenizer, engine_config = load_engine_config(
        EngineArgs(str(tiny_llama), enable_lora=True), log=False
    )
    engine = SimpleNamespace(
        config=engine_config,
        model_config=engine_config.model_config,
        tokenizer=tokenizer,
        input_processor=InputProcessor(engine_config, tokenizer),
    )
    metrics = PrometheusMetrics("m", 64, max_loras=1)
    app = build_app(engine, ServerConfig(("m",), **config), metrics)
    return {route.path for route in app.routes}


def test_runtime_lora_routes_exist_only_when_allowed(tiny_llama):
    lora_routes = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    assert not lora_routes & app_routes(tiny_llama)
    assert lora_routes <= app_routes(tiny_llama, allow_runtime_lora_updating=True)


def lora_stats(running: dict[str, int], waiting: dict[str, int]) -> EngineStats:
    counts = {"running_lora_adapters": running, "waiting_lora_adapters": waiting}
    return EngineStats(1, 1, 0, 0, 0.0, 0, 0, 0, 0, max_loras=2, **counts)


def info_lines(metrics: PrometheusMetrics) -> list[str]:
    text = metrics.render().decode()
    return [line for line in text.splitlines() if line.startswith("pagedllm:lora_requests_info")]


def test_lora_requests_info_keeps_one_current_series():
    metrics = PrometheusMetrics("m", 64, max_loras=2)
    metrics.on_step([], [], lora_stats({"b": 1, "a": 2, "idle": 0}, {"c": 1}), 0.0)
    [line] = info_lines(metrics)
    assert 'running_lora_adapters="a,b"' in line and 'waiting_lora_adapters="c"' in line
    assert 'max_lora="2"' in line and 'engine="0"' in line
    metrics.on_step([], [], lora_stats({}, {}), 0.0)
    [line] = info_lines(metrics)
    assert 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
    without = PrometheusMetrics("m", 64)
    without.on_step([], [], EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0), 0.0)
    assert not info_lines(without)
