"""`pagedllm bench serve` against a stub OpenAI server whose timings are known.

The stub (stub_openai_server.py, its own process) streams a token every ITL after a fixed
TTFT; the benchmark must report those from the timestamps it records, within 5%. Also:
the requests it sends, failures recorded rather than raised, the arrival schedule, the
plot and the config checks.
"""

import json
import socket
import statistics

import numpy as np
import pytest
from stub_openai_server import running_stub

from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.serve import (
    ServeBenchConfig,
    WordCodec,
    arrival_offsets,
    chunk_has_content,
    load_prompt_tokenizer,
    prepare_prompts,
    sse_data,
)
from pagedllm.entrypoints.cli import main

# The client's TTFT includes connecting and the stub process being scheduled: 5-15 ms on
# a 2-core machine with both cores busy, so TTFT is long enough for that to stay < 5%.
# ITL is measured between chunks the stub sends on absolute deadlines: jitter does not add up.
TTFT_MS = 1000.0
ITL_MS = 50.0
OUTPUT_LEN = 10
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(tmp_path, base_url, *flags):
    """Runs `bench serve` tokenizer-free; returns the exit status and the JSON report."""
    report_path = tmp_path / "report.json"
    status = main(
        [
            *("bench", "serve", "--base-url", base_url, "--tokenizer-free", "--disable-tqdm"),
            *("--output-json", str(report_path), *flags),
        ]
    )
    return status, json.loads(report_path.read_text())


def logged_requests(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_reports_the_stub_timings(tmp_path, capsys, monkeypatch, endpoint):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    log = tmp_path / "requests.jsonl"
    stub_flags = ["--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS), "--log", str(log)]
    with running_stub(*stub_flags) as url:
        status, report = bench(
            tmp_path, url, "--endpoint", endpoint, "--num-prompts", "6", "--input-len", "12",
            "--output-len", str(OUTPUT_LEN), "--goodput", "ttft:2000", "tpot:100",
            "--metric-percentiles", "50,99", "--plot", str(tmp_path / "run.png"),
        )  # fmt: skip
    assert status == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert (report["completed"], report["failed"], report["model"]) == (6, 0, "stub-model")
    assert report["output_lens"] == [OUTPUT_LEN] * 6
    assert report["total_output_tokens"] == 6 * OUTPUT_LEN
    # Prompt tokens come from the stub's usage: 12 words each.
    assert report["total_input_tokens"] == 72
    assert report["median_ttft_ms"] == pytest.approx(TTFT_MS, rel=0.05)
    assert report["mean_itl_ms"] == pytest.approx(ITL_MS, rel=0.05)
    assert report["median_tpot_ms"] == pytest.approx(ITL_MS, rel=0.05)
    assert report["median_e2el_ms"] == pytest.approx(TTFT_MS + (OUTPUT_LEN - 1) * ITL_MS, rel=0.05)
    assert all(len(gaps) == OUTPUT_LEN - 1 for gaps in report["itls"])
    assert report["request_goodput"] == report["request_throughput"] > 0
    assert sum(report["output_throughput_series"]) > 0
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    body = logged_requests(log)[0]
    assert body["path"] == endpoint and body["model"] == "stub-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == OUTPUT_LEN and body["temperature"] == 0.0
    assert "ignore_eos" not in body and body["authorization"] is None
    prompt = body["messages"][0]["content"] if "chat" in endpoint else body["prompt"]
    assert isinstance(prompt, str) and len(prompt.split()) == 12


def test_paced_requests_follow_the_schedule(tmp_path, monkeypatch):
    """rate 20/s with burstiness 1000 (near-regular gaps): the reported send rate is 20/s
    within 5%, and each request leaves at its seeded time."""
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    log = tmp_path / "requests.jsonl"
    with running_stub("--ttft-ms", "20", "--itl-ms", "20", "--log", str(log)) as url:
        status, report = bench(
            tmp_path, url, "--model", "stub-model", "--num-prompts", "30", "--input-len", "5",
            "--output-len", "2", "--request-rate", "20", "--burstiness", "1000", "--seed", "3",
            "--prompt-format", "token-ids", "--ignore-eos", "--vocab-size", "1000",
        )  # fmt: skip
    assert status == 0 and report["completed"] == 30
    assert report["request_send_rate"] == pytest.approx(20, rel=0.05)
    schedule = arrival_offsets(30, 20, 1000, 3)
    lateness = np.array(report["send_times"]) - np.array(schedule)
    assert lateness.min() >= 0 and statistics.median(lateness) < 0.02
    bodies = logged_requests(log)
    assert all(b["ignore_eos"] is True for b in bodies)
    assert all(b["authorization"] == "Bearer env-key" for b in bodies)
    assert all(len(b["prompt"]) == 5 and all(100 <= t < 1000 for t in b["prompt"]) for b in bodies)


def test_max_concurrency_caps_requests_in_flight(tmp_path):
    with running_stub("--ttft-ms", "60", "--itl-ms", "10") as url:
        status, report = bench(
            tmp_path, url, "--num-prompts", "6", "--output-len", "2", "--max-concurrency", "2"
        )
    assert status == 0 and report["completed"] == 6
    spans = [(s, s + e) for s, e in zip(report["send_times"], report["e2els"], strict=True)]
    in_flight = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(in_flight) == 2


def test_server_errors_are_failed_requests(tmp_path, capsys):
    with running_stub("--ttft-ms", "10", "--itl-ms", "10", "--fail-every", "2") as url:
        status, report = bench(tmp_path, url, "--num-prompts", "6", "--output-len", "3")
    assert status == 0
    assert (report["completed"], report["failed"]) == (3, 3)
    assert sum(e.startswith("HTTP 500") for e in report["errors"]) == 3
    assert report["total_output_tokens"] == 9
    assert "First error" in capsys.readouterr().out


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_server(tmp_path, capsys):
    url = _closed_port_url()
    plot = tmp_path / "empty.png"
    status, report = bench(tmp_path, url, "--model", "m", "--num-prompts", "3", "--plot", str(plot))
    # Every request failed: recorded, reported, plotted, and exit status 1.
    assert status == 1
    assert (report["completed"], report["failed"]) == (0, 3)
    assert all("Connect" in error for error in report["errors"])
    assert plot.read_bytes().startswith(PNG_MAGIC)
    # Without --model the run needs GET /v1/models: a clear error, exit status 2.
    assert main(["bench", "serve", "--base-url", url, "--tokenizer-free", "--disable-tqdm"]) == 2
    assert "/v1/models" in capsys.readouterr().err


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_schedule(burstiness):
    """Seeded, first request at 0, gaps with mean 1/rate and the coefficient of variation
    of a gamma(burstiness): 1/sqrt(burstiness) (1: Poisson)."""
    offsets = arrival_offsets(100_001, 4.0, burstiness, seed=7)
    assert offsets == arrival_offsets(100_001, 4.0, burstiness, seed=7)
    assert offsets != arrival_offsets(100_001, 4.0, burstiness, seed=8)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and gaps.min() >= 0
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.03)
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_sse_and_content_chunks():
    assert sse_data(b'data: {"a": 1}\n') == '{"a": 1}'
    assert sse_data(b"data:[DONE]") == "[DONE]"
    assert sse_data(b"\n") is None and sse_data(b": keep-alive\n") is None
    assert chunk_has_content({"choices": [{"text": "hi"}]})
    assert chunk_has_content({"choices": [{"delta": {"content": "hi"}}]})
    assert not chunk_has_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not chunk_has_content({"choices": [], "usage": {"completion_tokens": 3}})


def test_prompts_and_tokenizer_free():
    tokenizer, vocab_size = load_prompt_tokenizer(None, tokenizer_free=True, vocab_size=None)
    assert isinstance(tokenizer, WordCodec) and vocab_size == 32000
    # File prompts' words decode back to themselves.
    assert tokenizer.decode(tokenizer.encode("hello big world")) == "hello big world"
    requests = [BenchRequest([100, 101, 102], 4)]
    assert prepare_prompts(requests, tokenizer, "token-ids")[0].prompt == [100, 101, 102]
    text = prepare_prompts(requests, tokenizer, "text")[0]
    assert len(text.prompt.split()) == 3 and (text.prompt_len, text.output_len) == (3, 4)
    with pytest.raises(ValueError, match="tokenizer"):
        load_prompt_tokenizer("/no/such/model", tokenizer_free=False, vocab_size=None)
    with pytest.raises(ValueError, match="vocab_size"):
        load_prompt_tokenizer(None, tokenizer_free=True, vocab_size=50)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"base_url": "127.0.0.1:8000"}, "base_url"),
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"request_rate": 0}, "request_rate"),
        ({"burstiness": 0}, "burstiness"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"temperature": -1}, "temperature"),
        ({"goodput": ("ttft",)}, "goodput"),
        ({"percentile_metrics": ("ttft", "latency")}, "percentile_metrics"),
        ({"metric_percentiles": (0,)}, "metric_percentiles"),
        ({"prompt_format": "bytes"}, "prompt_format"),
        ({"endpoint": "/v1/chat/completions", "prompt_format": "token-ids"}, "token-ids"),
    ],
)
def test_config_is_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**settings)


def test_api_key_stays_out_of_the_report():
    config = ServeBenchConfig(api_key="secret")
    assert "secret" not in repr(config) and "api_key" not in config.public()
    assert config.public()["request_rate"] == "inf"
