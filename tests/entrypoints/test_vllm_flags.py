"""vLLM's launch lines run unchanged (issue 42, item 3), and unknown request fields are logged
and ignored as vLLM does, at any depth, unless `--strict-request-fields` (item 5).

The parsing and mapping tests are fast; one test starts `pagedllm serve` with a real `vllm
serve` line and talks to it through its root path."""

from __future__ import annotations

import argparse

import pytest
from server_utils import RunningServer
from tiers import slow_fixture

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.engine_flags import engine_args_from
from pagedllm.entrypoints.openai import serving as serving_module
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.entrypoints.serve_cli import _vllm_overrides
from pagedllm.entrypoints.vllm_flags import ENGINE_FLAGS, SERVE_FLAGS, compat_warnings

GIB = 1024**3

# A launch line as vLLM's docs and users' scripts write it (model and port left out).
VLLM_LINE = [
    "--gpu-memory-utilization", "0.3", "--trust-remote-code", "--enable-chunked-prefill",
    "--disable-log-requests", "--uvicorn-log-level", "warning", "--root-path", "/api",
    "--swap-space", "1", "--generation-config", "auto", "--guided-decoding-backend", "xgrammar",
    "--dtype", "auto", "--seed", "0", "--enforce-eager", "--disable-custom-all-reduce",
    "--distributed-executor-backend", "uni", "--tensor-parallel-size", "1", "-pp", "1",
    "--enable-prefix-caching", "--kv-cache-dtype", "auto", "--max-log-len", "100",
    "--disable-frontend-multiprocessing", "--response-role", "assistant",
    "--chat-template-content-format", "auto", "--enable-prompt-tokens-details",
    "--enable-server-load-tracking", "--return-tokens-as-token-ids", "--num-scheduler-steps",
    "1", "--revision", "main", "--download-dir", "/tmp/hf", "--load-format", "auto",
    "--hf-overrides", "{}",
]  # fmt: skip


def serve_args(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *args])


def all_warnings(args: argparse.Namespace) -> list[str]:
    values = {name: getattr(args, name, None) for name in ("preemption_mode", "kv_offload_memory")}
    return compat_warnings(args, ENGINE_FLAGS, values) + compat_warnings(args, SERVE_FLAGS)


def test_a_vllm_launch_line_parses_and_maps():
    args = serve_args(*VLLM_LINE)
    engine_args = engine_args_from(args)
    assert engine_args.gpu_memory_utilization == 0.3
    assert engine_args.kv_offload_memory is None  # --swap-space: recompute mode, warned
    assert _vllm_overrides(args) == {
        "allow_unknown_fields": True,
        "enable_log_requests": False,
        "uvicorn_log_level": "warning",
        "root_path": "/api",
    }
    warned = {line.split(" ")[0] for line in all_warnings(args)}
    # What pagedllm does anyway is silent: chunked prefill, the assistant role, string
    # content, one scheduler step.
    assert warned == {
        "--trust-remote-code", "--swap-space", "--generation-config", "--disable-custom-all-reduce",
        "--max-log-len", "--disable-frontend-multiprocessing", "--enable-prompt-tokens-details",
        "--enable-server-load-tracking", "--return-tokens-as-token-ids", "--revision",
        "--download-dir", "--hf-overrides",
    }  # fmt: skip


@pytest.mark.parametrize("flag", ENGINE_FLAGS + SERVE_FLAGS, ids=lambda flag: flag.name)
def test_every_compat_flag_is_one_warning_naming_it_and_why(flag):
    # A value that differs from what pagedllm does (a switch that is on here: its --no-x).
    given = {None: [f"--{flag.name}"], str: [f"--{flag.name}", "x"], int: [f"--{flag.name}", "7"],
             float: [f"--{flag.name}", "2.5"]}[flag.kind]  # fmt: skip
    if flag.kind is None and True in flag.same:
        given = [f"--no-{flag.name}"]
    lines = [line for line in all_warnings(serve_args(*given)) if f"-{flag.name}" in line]
    assert lines == [f"{' '.join(given)} has no effect: {flag.why}"]


def test_the_values_pagedllm_follows_anyway_are_silent():
    args = serve_args(
        "--no-trust-remote-code", "--enable-chunked-prefill", "--generation-config", "vllm",
        "--no-enable-sleep-mode", "--response-role", "assistant", "--enable-request-id-headers",
        "--cpu-offload-gb", "0",
    )  # fmt: skip
    assert all_warnings(args) == []


def test_trust_remote_code_warning_says_no_remote_code_runs():
    (line,) = all_warnings(serve_args("--trust-remote-code"))
    assert "never runs code from a model's repository" in line


def test_no_chunked_prefill_is_warned():
    (line,) = all_warnings(serve_args("--no-enable-chunked-prefill"))
    assert line.startswith("--no-enable-chunked-prefill has no effect: prefill is always chunked")


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_guided_decoding_backend_served_is_accepted(backend):
    assert serve_args("--guided-decoding-backend", backend).guided_decoding_backend == backend


def test_guided_decoding_backend_not_served_is_refused_naming_ours(capsys):
    with pytest.raises(SystemExit):
        serve_args("--guided-decoding-backend", "outlines")
    err = capsys.readouterr().err
    assert "'outlines' is not available; this server has 'xgrammar'" in err


def test_swap_space_sizes_the_swap_tier_in_swap_mode():
    args = serve_args("--swap-space", "2", "--preemption-mode", "swap")
    assert engine_args_from(args).kv_offload_memory == 2 * GIB
    assert all_warnings(args) == []


@pytest.mark.parametrize(
    "extra", [[], ["--preemption-mode", "swap", "--kv-offload-memory", "1GiB"]]
)
def test_swap_space_without_effect_is_warned(extra):
    args = serve_args("--swap-space", "2", *extra)
    assert engine_args_from(args).kv_offload_memory == (extra[-1] if extra else None)
    assert [line.split(" ")[0] for line in all_warnings(args)] == ["--swap-space"]


def test_disable_log_requests_wins_over_enable():
    args = serve_args("--enable-log-requests", "--disable-log-requests")
    assert _vllm_overrides(args)["enable_log_requests"] is False
    assert _vllm_overrides(serve_args("--enable-log-requests"))["enable_log_requests"] is True


def test_strict_request_fields_and_the_old_allow_switch():
    assert _vllm_overrides(serve_args())["allow_unknown_fields"] is True
    assert _vllm_overrides(serve_args("--allow-unknown-fields"))["allow_unknown_fields"] is True
    assert _vllm_overrides(serve_args("--strict-request-fields"))["allow_unknown_fields"] is False
    with pytest.raises(ValueError, match="exclude each other"):
        _vllm_overrides(serve_args("--strict-request-fields", "--allow-unknown-fields"))


def test_uvicorn_log_level_choices_and_root_path_default():
    args = serve_args()
    assert (args.uvicorn_log_level, args.root_path) == ("info", None)
    with pytest.raises(SystemExit):
        serve_args("--uvicorn-log-level", "loud")


def test_kv_cache_memory_bytes_is_kv_cache_memory():
    assert engine_args_from(serve_args("--kv-cache-memory-bytes", "1GiB")).kv_cache_memory == (
        "1GiB"
    )


def test_gpu_memory_utilization_beside_an_exact_size_is_warned():
    args = serve_args("--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1GiB")
    values = {"gpu_memory_utilization": 0.5, "kv_cache_memory": "1GiB"}
    (line,) = compat_warnings(args, ENGINE_FLAGS, values)
    assert line.startswith("--gpu-memory-utilization 0.5 has no effect: --kv-cache-memory")


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, True])
def test_gpu_memory_utilization_out_of_range_is_refused(fraction):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=fraction)


def test_gpu_memory_utilization_sizes_the_pool(tiny_llama, monkeypatch):
    """The pool is what max_num_seqs (+ 1) sequences at max_model_len need, capped by the
    share of the available memory the fraction gives (half without it)."""
    from pagedllm.core import engine_config
    from pagedllm.core.engine_config import load_engine_config

    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 1000 * 1024**2)
    small = dict(model=str(tiny_llama), max_model_len=64, max_num_seqs=2)
    needed = load_engine_config(EngineArgs(**small), log=False)[2].cache_config
    many = {**small, "max_num_seqs": 256}
    capped = load_engine_config(EngineArgs(**many, gpu_memory_utilization=0.001), log=False)
    cache = capped[2].cache_config
    per_block = cache.kv_cache_memory // cache.num_blocks
    assert 1024**2 - per_block < cache.kv_cache_memory <= 1024**2  # 0.001 of 1000 MiB
    assert needed.kv_cache_memory < 1024**2  # two sequences need less than the share
    # Without the fraction, half of 1000 MiB: room for all 256 + 1 sequences (4 blocks each).
    half = load_engine_config(EngineArgs(**many), log=False)[2].cache_config
    assert half.num_blocks == (256 + 1) * 4 + 1


# ---- unknown request fields (item 5) ----------------------------------------------------
def checker(strict: bool) -> OpenAIServing:
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.config = argparse.Namespace(allow_unknown_fields=not strict)
    return serving


INSTRUCTOR_JSON_SCHEMA = {
    "messages": [{"role": "user", "content": "hi", "colour": "red"}],
    "response_format": {"type": "json_object", "schema": {"type": "object"}},
    "vendor_knob": 3,
}


def test_unknown_fields_are_named_by_path_at_any_depth():
    request = ChatCompletionRequest.model_validate(INSTRUCTOR_JSON_SCHEMA)
    assert request.unknown_fields() == [
        "vendor_knob",
        "messages[0].colour",
        "response_format.schema",
    ]
    responses = ResponsesRequest.model_validate(
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "y": 1}]}]}
    )
    assert responses.unknown_fields() == ["input[0].content[0].y"]


def test_unknown_fields_are_logged_and_ignored_by_default(monkeypatch):
    logged = []
    monkeypatch.setattr(serving_module.logger, "warning", lambda *a: logged.append(a[0] % a[1:]))
    request = ChatCompletionRequest.model_validate(INSTRUCTOR_JSON_SCHEMA)
    checker(strict=False).check_unknown(request)
    (line,) = logged
    assert "vendor_knob, messages[0].colour, response_format.schema" in line
    # instructor's JSON_SCHEMA mode: as in vLLM, json_object is any JSON object, and the log
    # says the schema is not enforced and how to have it enforced.
    assert "not enforced" in line and '"type": "json_schema"' in line
    (source,) = request.structured_output_sources()
    assert source[0] == "response_format" and source[1].json_object


def test_unknown_fields_are_a_400_naming_the_path_under_strict():
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **{"response_format": {
            "type": "json_object", "schema": {}}}}
    )  # fmt: skip
    with pytest.raises(OpenAIError) as error:
        checker(strict=True).check_unknown(request)
    assert error.value.status == 400 and error.value.param == "response_format.schema"
    assert "--strict-request-fields" in str(error.value.message)
    nested = CompletionRequest.model_validate({"prompt": "x", "stream_options": {"z": 1}})
    with pytest.raises(OpenAIError) as error:
        checker(strict=True).check_unknown(nested)
    assert error.value.param == "stream_options.z"


# ---- a real launch line -----------------------------------------------------------------
@pytest.fixture(scope="module")
@slow_fixture
def vllm_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-line") / "server.log"
    args = [*VLLM_LINE, "--max-num-seqs", "4", "--max-model-len", "512"]
    running = RunningServer(args, log)
    yield running
    assert running.stop() == 0, running.log()


def test_the_server_starts_from_a_vllm_launch_line_and_answers(vllm_server):
    body = {"prompt": "Hello", "max_tokens": 2, "vendor_knob": 1, "stream_options": None}
    for prefix in ("/api", ""):  # behind a proxy that keeps the root path, or strips it
        assert vllm_server.get(f"{prefix}/health").status_code == 200
        models = vllm_server.get(f"{prefix}/v1/models")
        assert models.status_code == 200, models.text
        completion = vllm_server.post(f"{prefix}/v1/completions", body)
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 2
    chat = vllm_server.post("/api/v1/chat/completions", {**INSTRUCTOR_JSON_SCHEMA, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    log = vllm_server.log()
    assert "--trust-remote-code has no effect" in log and "--max-log-len 100 has no effect" in log
    assert log.count("--trust-remote-code has no effect") == 1
    assert "Ignoring unknown request field(s): vendor_knob" in log
    assert "Uvicorn running on" not in log  # --uvicorn-log-level warning


def test_root_path_strips_only_its_own_prefix():
    import asyncio

    from pagedllm.entrypoints.openai.api_server import RootPath

    seen = []

    async def app(scope, receive, send):
        seen.append((scope["path"], scope["root_path"]))

    wrapped = RootPath(app, "/api/")
    for path in ("/api/v1/models", "/api", "/v1/models", "/apix"):
        asyncio.run(wrapped({"type": "http", "path": path, "root_path": ""}, None, None))
    assert seen == [
        ("/v1/models", "/api"),
        ("/", "/api"),
        ("/v1/models", "/api"),
        ("/apix", "/api"),
    ]
