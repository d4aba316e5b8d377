"""`pagedllm bench serve` against a stub OpenAI server whose timings are known.

The stub (stub_openai_server.py, its own process) streams a token every ITL after a fixed
TTFT. No timing is asserted within a tolerance (how close a client's clock comes to the
stub's depends on the machine): what the benchmark reports must follow from the timestamps
it records, those timestamps must respect what the stub makes impossible (no token before
its time), and a chunk is timed when it arrives (a stream held open shows it). Also: the
requests it sends, failures recorded rather than raised, the arrival schedule, the plot and
the config checks.
"""

import json
import socket
import statistics
import threading

import numpy as np
import pytest
from stub_openai_server import running_stub

from pagedllm.entrypoints.bench import serve
from pagedllm.entrypoints.bench.datasets import BenchRequest
from pagedllm.entrypoints.bench.serve import (
    ServeBenchConfig,
    WordCodec,
    arrival_offsets,
    chunk_has_content,
    load_prompt_tokenizer,
    prepare_prompts,
    sse_data,
)
from pagedllm.entrypoints.cli import main

# The stub's first token comes TTFT_MS after the request arrived, the last
# (OUTPUT_LEN - 1) * ITL_MS later: no client can see them sooner (later, by any amount).
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


@pytest.mark.slow  # the stub server in a process
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
    ttfts, itls, tpots, e2els = (report[k] for k in ("ttfts", "itls", "tpots", "e2els"))
    # One gap between each two content chunks: the role chunk, the finish chunk and the
    # usage chunk are not tokens.
    assert all(len(gaps) == OUTPUT_LEN - 1 for gaps in itls)
    # Timed at the first content chunk (the content-free first chunk comes at once), and to
    # the end of the stream: never sooner than the stub sent them.
    assert min(ttfts) >= TTFT_MS / 1000
    assert min(e2els) >= (TTFT_MS + (OUTPUT_LEN - 1) * ITL_MS) / 1000
    for first, gaps, tpot, end in zip(ttfts, itls, tpots, e2els, strict=True):
        assert first + sum(gaps) <= end  # every token before the end
        assert tpot == pytest.approx((end - first) / (OUTPUT_LEN - 1))
    # The summary is the per-request timings' (seconds), in ms.
    assert report["median_ttft_ms"] == pytest.approx(1000 * statistics.median(ttfts))
    assert report["mean_itl_ms"] == pytest.approx(1000 * np.mean(np.concatenate(itls)))
    assert report["median_tpot_ms"] == pytest.approx(1000 * statistics.median(tpots))
    assert report["median_e2el_ms"] == pytest.approx(1000 * statistics.median(e2els))
    assert report["p99_ttft_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99))
    # Goodput counts the requests within both bounds (ttft:2000, tpot:100), whichever they are.
    met = sum(t <= 2.0 and p <= 0.1 for t, p in zip(ttfts, tpots, strict=True))
    assert report["request_goodput"] == pytest.approx(met / report["duration"])
    assert report["request_throughput"] == pytest.approx(6 / report["duration"])
    assert sum(report["output_throughput_series"]) > 0
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    body = logged_requests(log)[0]
    assert body["path"] == endpoint and body["model"] == "stub-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == OUTPUT_LEN and body["temperature"] == 0.0
    assert "ignore_eos" not in body and body["authorization"] is None
    prompt = body["messages"][0]["content"] if "chat" in endpoint else body["prompt"]
    assert isinstance(prompt, str) and len(prompt.split()) == 12


@pytest.mark.slow  # the stub server in a process
def test_paced_requests_follow_the_schedule(tmp_path, monkeypatch):
    """rate 20/s with burstiness 1000 (near-regular gaps): each request leaves at its seeded
    time, never before it and in its order, and the reported send rate is that of the send
    times (how late a busy machine sends them is for benchmarks to measure)."""
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    log = tmp_path / "requests.jsonl"
    with running_stub("--ttft-ms", "20", "--itl-ms", "20", "--log", str(log)) as url:
        status, report = bench(
            tmp_path, url, "--model", "stub-model", "--num-prompts", "30", "--input-len", "5",
            "--output-len", "2", "--request-rate", "20", "--burstiness", "1000", "--seed", "3",
            "--prompt-format", "token-ids", "--ignore-eos", "--vocab-size", "1000",
        )  # fmt: skip
    assert status == 0 and report["completed"] == 30
    schedule = arrival_offsets(30, 20, 1000, 3)
    sends = report["send_times"]
    assert min(np.array(sends) - np.array(schedule)) >= 0
    assert sends == sorted(sends)  # the schedule's order (its offsets increase)
    assert report["request_send_rate"] == pytest.approx(29 / (sends[-1] - sends[0]))
    bodies = logged_requests(log)
    assert all(b["ignore_eos"] is True for b in bodies)
    assert all(b["authorization"] == "Bearer env-key" for b in bodies)
    assert all(len(b["prompt"]) == 5 and all(100 <= t < 1000 for t in b["prompt"]) for b in bodies)


@pytest.mark.slow  # the stub server in a process
def test_content_chunks_are_timed_as_they_arrive(tmp_path, monkeypatch):
    """The client sees (and times) a stream's first token while the stream is still open:
    the stub holds every stream after its first token until the test has seen the client
    see one. A client that read streams whole would never get there (and fail at the
    hang-guard)."""
    release = tmp_path / "release"
    seen = threading.Event()
    has_content = serve.chunk_has_content

    def watched(chunk) -> bool:
        if has_content(chunk):
            seen.set()
            return True
        return False

    monkeypatch.setattr(serve, "chunk_has_content", watched)
    result = {}
    stub_flags = ("--ttft-ms", "10", "--itl-ms", "10", "--hold-file", str(release))
    with running_stub(*stub_flags) as url:
        flags = ("--num-prompts", "1", "--output-len", "3")
        thread = threading.Thread(target=lambda: result.update(run=bench(tmp_path, url, *flags)))
        thread.start()
        try:
            assert seen.wait(60), "no token seen while its stream was held open"
        finally:
            release.touch()
            thread.join(60)
    status, report = result["run"]
    assert status == 0 and report["completed"] == 1
    assert len(report["itls"][0]) == 2


@pytest.mark.slow  # the stub server in a process
def test_max_concurrency_caps_requests_in_flight(tmp_path):
    with running_stub("--ttft-ms", "60", "--itl-ms", "10") as url:
        status, report = bench(
            tmp_path, url, "--num-prompts", "6", "--output-len", "2", "--max-concurrency", "2"
        )
    assert status == 0 and report["completed"] == 6
    spans = [(s, s + e) for s, e in zip(report["send_times"], report["e2els"], strict=True)]
    in_flight = [sum(s <= t < e for s, e in spans) for t, _ in spans]
    assert max(in_flight) == 2


@pytest.mark.slow  # the stub server in a process
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
