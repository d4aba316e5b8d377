"""The admin role and what tenants may see of each other (issue 47, items 3, 4 and 6).

One server with three tenants (alice, bob; ops an admin by the keys file's `admin` column),
`--admin-api-key`, a `--lora-modules` adapter and runtime LoRA updating. Tenant bob calls
every tenant-visible route with alice's and the operator's names: nothing he sees tells him
about them, and nothing he sends changes what they are served. The admin loads and unloads,
never a `--lora-modules` adapter, and only from under the path root, with one answer for
every path that cannot be used. The registry, the keys file's column and the roles are also
tested without a server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from lora_utils import make_peft_adapter
from server_utils import RunningServer
from tiers import slow_fixture

from pagedllm.core.messages import EngineCoreOutput
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.lora_registry import (
    NO_PATH_ROOT,
    UNLOADABLE_PATH,
    LoRAModulePath,
    LoRARegistry,
)
from pagedllm.entrypoints.openai.tenant_limits import TenantLimits
from pagedllm.entrypoints.openai.tenants import TenantRegistry, parse_keys_file
from pagedllm.lora.peft import LoRAAdapterError, LoRAAdapterFileError
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.frontend.prometheus import PrometheusMetrics
from pagedllm.metrics.stats import EngineStats

BASE = "tiny-base"
ADMIN_KEY = "sk-admin-000"
KEYS = {"alice": "sk-alice-111", "bob": "sk-bob-222", "ops": "sk-ops-333"}
KEYS_FILE = f"""alice {KEYS["alice"]}
bob   {KEYS["bob"]}
ops   {KEYS["ops"]} admin
"""
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def lora_dirs(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """The root (holding the static adapter `sql` and a loadable `chat`), and outside it a
    valid adapter reached by `..` and by a link inside the root, a file and an empty dir."""
    top = tmp_path_factory.mktemp("admin-lora")
    root, outside = top / "adapters", top / "outside"
    make_peft_adapter(tiny_llama, root / "sql", seed=1, std=0.1)
    make_peft_adapter(tiny_llama, root / "chat", seed=2, rank=4, std=0.1)
    make_peft_adapter(tiny_llama, outside / "evil", seed=3, rank=4, std=0.1)
    (root / "link").symlink_to(outside / "evil")
    (root / "notes.txt").write_text("not an adapter")
    (root / "empty").mkdir()
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
@slow_fixture
def admin_server(tiny_llama, lora_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("admin-server")
    keys_file = logs / "keys.txt"
    keys_file.write_text(KEYS_FILE)
    args = [str(tiny_llama), "--served-model-name", BASE, "--enable-lora", "--max-loras", "2"]
    args += ["--max-lora-rank", "16", "--lora-modules", f"sql={lora_dirs['root'] / 'sql'}"]
    args += ["--allow-runtime-lora-updating", "--api-keys-file", str(keys_file)]
    args += ["--admin-api-key", ADMIN_KEY]
    running = RunningServer(args, logs / "server.log")
    running.api_key = ADMIN_KEY  # server.get / server.post: as the admin
    yield running
    assert running.stop() == 0, running.log()


def call(server, key: str, method: str, path: str, body=None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    url = server.base_url + path
    return httpx.request(method, url, json=body, headers=headers, timeout=120)


def complete(server, key: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = call(server, key, "POST", "/v1/completions", {**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def model_ids(server, key: str = ADMIN_KEY) -> list[str]:
    return [card["id"] for card in call(server, key, "GET", "/v1/models").json()["data"]]


def load(server, key: str, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return call(server, key, "POST", "/v1/load_lora_adapter", body)


def unload(server, key: str, name: str) -> httpx.Response:
    return call(server, key, "POST", "/v1/unload_lora_adapter", {"lora_name": name})


# ---- one server, end to end ------------------------------------------------------------------
def test_a_tenant_can_neither_load_nor_unload(admin_server, lora_dirs):
    """Bob cannot unload the operator's adapter, replace it with his weights, or touch an
    adapter the admin loaded; his answers are the same whatever the name."""
    root = lora_dirs["root"]
    sql_text = complete(admin_server, KEYS["alice"], "sql")
    assert load(admin_server, ADMIN_KEY, "alices", str(root / "chat")).status_code == 200
    alices_text = complete(admin_server, KEYS["alice"], "alices")
    before = model_ids(admin_server)
    answers = [
        unload(admin_server, KEYS["bob"], "sql"),
        load(admin_server, KEYS["bob"], "sql", str(root / "chat")),
        unload(admin_server, KEYS["bob"], "alices"),
        load(admin_server, KEYS["bob"], "alices", str(root / "sql")),
        unload(admin_server, KEYS["bob"], "no-such-adapter"),
        load(admin_server, KEYS["bob"], "bobs", str(root / "chat")),
        call(admin_server, KEYS["bob"], "POST", "/v1/unload_lora_adapter", {"x": [1]}),
    ]
    assert {answer.status_code for answer in answers} == {403}
    assert len({answer.text for answer in answers}) == 1, [a.text for a in answers]
    assert answers[0].json()["error"]["type"] == "PermissionDeniedError"
    assert model_ids(admin_server) == before
    assert complete(admin_server, KEYS["alice"], "sql") == sql_text
    assert complete(admin_server, KEYS["alice"], "alices") == alices_text
    assert unload(admin_server, ADMIN_KEY, "alices").status_code == 200


def test_admins_load_and_unload_but_never_a_static_adapter(admin_server, lora_dirs):
    root = lora_dirs["root"]
    for response in (
        unload(admin_server, ADMIN_KEY, "sql"),
        load(admin_server, KEYS["ops"], "sql", str(root / "chat")),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "lora_name" and "'sql'" in error["message"], error
        assert "--lora-modules" in error["message"], error
    assert "sql" in model_ids(admin_server)
    # ops is an admin by the keys file's column; `..` that stays under the root is fine.
    assert load(admin_server, KEYS["ops"], "chat", f"{root}/sql/../chat").status_code == 200
    assert complete(admin_server, KEYS["bob"], "chat")  # adapters serve every tenant
    assert unload(admin_server, KEYS["ops"], "chat").status_code == 200
    assert "chat" not in model_ids(admin_server)


def test_paths_that_cannot_be_used_get_one_answer(admin_server, lora_dirs):
    root, outside = lora_dirs["root"], lora_dirs["outside"]
    paths = [
        "/etc/passwd",
        "/root",
        "/nonexistent",
        str(outside / "evil"),  # a valid adapter, outside the root
        f"{root}/../outside/evil",  # the same through `..`
        str(root / "link"),  # the same through a link inside the root
        str(root / "notes.txt"),
        str(root / "empty"),
        str(root / "missing"),
        "relative/path",
        "a\u0000b",
    ]
    answers = [load(admin_server, ADMIN_KEY, "probe", path) for path in paths]
    assert {answer.status_code for answer in answers} == {400}
    assert len({answer.text for answer in answers}) == 1, [a.text for a in answers]
    error = answers[0].json()["error"]
    assert error["message"] == UNLOADABLE_PATH and error["param"] == "lora_path"
    assert "probe" not in model_ids(admin_server)


def test_models_show_tenants_names_not_paths(admin_server, lora_dirs, tiny_llama):
    text = call(admin_server, KEYS["bob"], "GET", "/v1/models").text
    assert str(lora_dirs["root"]) not in text and str(tiny_llama) not in text
    cards = {card["id"]: card for card in json.loads(text)["data"]}
    assert cards["sql"]["root"] == "sql" and cards["sql"]["parent"] == BASE
    assert cards[BASE]["root"] == BASE and cards[BASE]["parent"] is None
    admin_cards = {card["id"]: card for card in admin_server.get("/v1/models").json()["data"]}
    assert admin_cards["sql"]["root"] == str(lora_dirs["root"] / "sql")
    assert set(admin_cards["sql"]) == set(cards["sql"])  # vLLM's fields either way


def test_metrics_show_a_tenant_its_own_series(admin_server):
    complete(admin_server, KEYS["alice"], BASE)
    complete(admin_server, KEYS["bob"], BASE)
    text = call(admin_server, KEYS["bob"], "GET", "/metrics?tenant=alice").text
    assert set(re.findall(r'tenant="([^"]*)"', text)) == {"bob"}
    assert "alice" not in text and "ops" not in text
    assert 'engine="' not in text and "lora_requests_info" not in text
    assert re.search(r'pagedllm:generation_tokens_total\{[^}]*tenant="bob"[^}]*\} \d', text)
    everyone = admin_server.get("/metrics").text
    assert {"alice", "bob"} <= set(re.findall(r'tenant="([^"]*)"', everyone))
    assert 'engine="0"' in everyone and "lora_requests_info" in everyone
    assert call(admin_server, KEYS["ops"], "GET", "/metrics").text.count('tenant="alice"') > 0


def test_dashboard_data_shows_a_tenant_its_own_figures(admin_server):
    complete(admin_server, KEYS["alice"], BASE)
    complete(admin_server, KEYS["bob"], BASE)
    bob = call(admin_server, KEYS["bob"], "GET", "/dashboard/data").json()
    assert "alice" not in json.dumps(bob)
    assert bob["samples"] and all(set(s["tenants"]) <= {"bob"} for s in bob["samples"])
    assert all(s["running"] is None and "lora_adapters" not in s for s in bob["samples"])
    assert bob["totals"]["finished"] >= 1 and bob["totals"]["preemptions"] is None
    # A sample is a closed second: one that ended after bob's request began names bob.
    everyone = _dashboard_once_a_second_closes(admin_server)
    assert {"alice", "bob"} <= {name for s in everyone["samples"] for name in s["tenants"]}
    assert everyone["totals"]["finished"] > bob["totals"]["finished"]


def _dashboard_once_a_second_closes(server) -> dict:
    """The admin's dashboard data once a second has closed since this call (the series
    closes seconds as it is read; on a fast machine both requests fit in one second)."""
    start = server.get("/dashboard/data").json()["now"]
    for _ in range(50):
        data = server.get("/dashboard/data").json()
        if data["samples"] and data["samples"][-1]["t"] > start:
            return data
        time.sleep(0.1)
    raise AssertionError("no second of the dashboard series closed within 5 s")


# ---- without a server ------------------------------------------------------------------------
def test_keys_file_admin_column():
    specs = parse_keys_file(
        "a sk-a\nb sk-b admin max_requests_per_minute=5\n", TenantLimits(), "keys.txt"
    )
    assert [(spec.name, spec.admin) for spec in specs] == [("a", False), ("b", True)]
    assert specs[1].limits.max_requests_per_minute == 5


def admins(registry: TenantRegistry, keys: list[str]) -> list[bool]:
    return [registry.authenticate(f"Bearer {key}").admin for key in keys]


def test_who_is_an_admin(tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("a sk-a\nb sk-b admin\n")
    # No tenants: the one user (no key, or one --api-key) is the admin, as before roles.
    assert TenantRegistry().authenticate(None).admin
    assert admins(TenantRegistry(["sk-1"]), ["sk-1"]) == [True]
    # Tenants: only a designated admin.
    assert admins(TenantRegistry(["sk-1", "sk-2"]), ["sk-1", "sk-2"]) == [False, False]
    with_admin = TenantRegistry(["sk-1"], admin_api_key="sk-root")
    assert admins(with_admin, ["sk-1", "sk-root"]) == [False, True]
    from_file = TenantRegistry(["sk-1"], str(keys_file))
    assert admins(from_file, ["sk-1", "sk-a", "sk-b"]) == [False, False, True]
    keys_file.write_text("a sk-a admin\nb sk-b\n")
    assert from_file.reload()
    assert admins(from_file, ["sk-a", "sk-b"]) == [True, False]
    keys_file.write_text("admin sk-x\n")  # the name of --admin-api-key's tenant
    with pytest.raises(ValueError, match="'admin' is used twice"):
        TenantRegistry([], str(keys_file), admin_api_key="sk-root")


def fake_check(lora_request: LoRARequest) -> None:
    """The engine's check in brief: a directory with a config file is an adapter."""
    path = lora_request.lora_path
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise LoRAAdapterFileError(f"LoRA adapter {lora_request.lora_name!r}: nothing at {path}")
    if "rank99" in path:
        raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: rank r=99 too large")


def fake_adapter(path: Path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def refusal(registry: LoRARegistry, name: str, path: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        asyncio.run(registry.load(name, path))
    return error.value


def test_registry_roots_default_to_the_static_adapters_directories(tmp_path):
    static = fake_adapter(tmp_path / "root" / "static")
    loadable = fake_adapter(tmp_path / "root" / "other")
    outside = fake_adapter(tmp_path / "elsewhere" / "adapter")
    (tmp_path / "root" / "link").symlink_to(outside)
    registry = LoRARegistry(("base",), fake_check)
    assert refusal(registry, "x", loadable).message == NO_PATH_ROOT  # no root at all
    registry.add_static((LoRAModulePath("static", static),))
    for path in (outside, str(tmp_path / "root" / "link"), f"{loadable}/../../elsewhere/adapter"):
        error = refusal(registry, "x", path)
        assert (error.status, error.message, error.param) == (400, UNLOADABLE_PATH, "lora_path")
    assert asyncio.run(registry.load("x", loadable)).lora_path == loadable
    rank = fake_adapter(tmp_path / "root" / "rank99")
    assert "r=99" in refusal(registry, "y", rank).message  # a readable adapter: the reason
    assert "already been loaded" in refusal(registry, "x", loadable).message
    assert "cannot be replaced" in refusal(registry, "static", loadable).message
    with pytest.raises(OpenAIError, match="cannot be unloaded") as error:
        registry.unload("static")
    assert error.value.status == 400 and error.value.param == "lora_name"
    assert registry.resolve("static") is not None


def test_registry_with_an_explicit_root(tmp_path):
    static = fake_adapter(tmp_path / "static" / "a")
    inside = fake_adapter(tmp_path / "root" / "deep" / "b")
    registry = LoRARegistry(("base",), fake_check, (str(tmp_path / "root"),))
    registry.add_static((LoRAModulePath("a", static),))
    assert refusal(registry, "c", static).message == UNLOADABLE_PATH  # not a root now
    assert asyncio.run(registry.load("b", inside)).lora_path == inside


def test_a_missing_path_root_fails_before_the_model_loads(capsys):
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-path-root", "/no/such"]
    assert main(["serve", "no-such-model-dir", *flags]) == 2
    assert "--lora-path-root: '/no/such' is not a directory" in capsys.readouterr().err


def test_prometheus_render_for_one_tenant():
    metrics = PrometheusMetrics("m", 64, max_loras=2)
    for request_id, tenant in (("a", "alice"), ("b", "bob")):
        metrics.on_request_added(request_id, 100.0, 4, tenant)
    outputs = [EngineCoreOutput("a", [1, 2], False), EngineCoreOutput("b", [1], False)]
    metrics.on_step(outputs, [], EngineStats(2, 0, 0, 0, 0.5, 0, 0, 0, 0, max_loras=2), 100.5)
    bob = metrics.render("bob").decode()
    assert set(re.findall(r'tenant="([^"]*)"', bob)) == {"bob"}
    assert 'engine="' not in bob and "alice" not in bob
    assert 'pagedllm:generation_tokens_total{model_name="m",tenant="bob"} 1.0' in bob
    everyone = metrics.render().decode()
    assert {"alice", "bob"} <= set(re.findall(r'tenant="([^"]*)"', everyone))
    assert 'engine="0"' in everyone
    assert metrics.render("nobody").decode() == ""
