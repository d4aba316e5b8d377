"""`serve --speculative-config`: the server speculates (the tiny model drafting for itself),
answers with the offline engine's greedy text, streams it, and reports vLLM's
spec_decode counters in /metrics; a bad config stops the start with the problem named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from process_guard import dies_with_us
from server_utils import RunningServer, offline_greedy_texts

pytestmark = pytest.mark.slow  # servers

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 4, [(7 * i) % 500 + 3 for i in range(30)]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[str]:
    """One rank's greedy texts (offline engine) for PROMPTS."""
    return offline_greedy_texts(tiny_llama, PROMPTS, MAX_TOKENS)


def test_server_speculates_and_reports_its_counters(tiny_llama, tmp_path, reference):
    config = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    args = [str(tiny_llama), "--speculative-config", json.dumps(config)]
    server = RunningServer(args, tmp_path / "spec.log")
    try:
        body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, text in zip(PROMPTS, reference, strict=True):
            response = server.post("/v1/completions", {**body, "prompt": prompt})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        streamed = server.post("/v1/completions", {**body, "prompt": PROMPTS[0], "stream": True})
        chunks = [
            json.loads(line[len("data: ") :])
            for line in streamed.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference[0]
        metrics = server.get("/metrics").text
        accepted = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("pagedllm:spec_decode_num_accepted_tokens_total{")
        ]
        assert accepted and accepted[0] > 0
        assert "pagedllm:spec_decode_num_drafts_total{" in metrics
        assert "pagedllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics
    finally:
        server.stop()


def test_bad_speculative_config_stops_the_start(tiny_llama):
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama)]
    command += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}']
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, preexec_fn=dies_with_us()
    )
    assert result.returncode != 0
    assert "speculative_config.num_speculative_tokens must be a positive integer" in (
        result.stderr + result.stdout
    )
