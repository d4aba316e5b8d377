"""benchmarks.real_size: the batched workload's spec, llama-batched-bench's report read into
the same figures as pagedllm's, and concurrent prompts that share no cached prefix."""

from __future__ import annotations

import json
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from benchmarks import real_size


def test_batched_spec_is_sequences_prompt_and_output_tokens():
    assert real_size.parse_batched("32,128,64") == {
        "sequences": 32,
        "prompt_tokens": 128,
        "output_tokens": 64,
    }
    assert real_size.parse_batched("0") is None
    assert real_size.parse_batched("") is None
    with pytest.raises(ValueError):
        real_size.parse_batched("32,128")


def test_batched_bench_report_becomes_whole_time_and_output_rate(tmp_path):
    # A stand-in for llama-batched-bench: its markdown header, then one JSONL result line.
    row = {"n_kv_max": 6144, "pp": 128, "tg": 64, "pl": 32, "t_pp": 30.5, "t_tg": 33.5, "t": 64.0}
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho 'main: n_kv_max = 6144'\necho '{json.dumps(row)}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    batched = {"sequences": 32, "prompt_tokens": 128, "output_tokens": 64}
    report = real_size.llama_batched_bench(fake, tmp_path / "model.gguf", batched)
    assert report == {"seconds": 64.0, "prompt_seconds": 30.5, "output_tok_s": 32.0}


class _Completions(BaseHTTPRequestHandler):
    prompts: ClassVar[list[str]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.prompts.append(body["prompt"])
        reply = json.dumps({"usage": {"completion_tokens": body["max_tokens"]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_concurrent_prompts_differ_from_their_first_token():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        result = real_size.concurrent_output_rate(base_url, "same text", 3, concurrency=5)
    finally:
        server.shutdown()
        server.server_close()
    assert result["completed"] == 5
    prompts = _Completions.prompts
    assert len(set(prompts)) == 5
    assert len({prompt.split()[0] for prompt in prompts}) == 5
