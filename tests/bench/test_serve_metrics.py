"""`bench serve` metrics on synthetic timestamps, against values computed by hand."""

import math

import pytest

from pagedllm.entrypoints.bench.serve_metrics import (
    RequestOutcome,
    compute_metrics,
    itls,
    meets_slos,
    parse_goodput,
    per_request_arrays,
    send_rate,
    summarize,
    token_rate_series,
    tpot,
    ttft,
)

# A: 3 tokens. B: 1 token (no TPOT). C: failed. D: 8 tokens in 4 chunks (2 per chunk).
A = RequestOutcome(0.0, 0.3, (0.1, 0.15, 0.25), output_tokens=3, prompt_tokens=10)
B = RequestOutcome(1.0, 1.2, (1.2,), output_tokens=1, prompt_tokens=5)
C = RequestOutcome(0.5, 0.6, prompt_tokens=7, error="HTTP 500: boom")
D = RequestOutcome(2.0, 2.7, (2.3, 2.4, 2.5, 2.6), output_tokens=8, prompt_tokens=20)
RUN = [A, B, C, D]


def test_per_request_latencies():
    assert ttft(A) == pytest.approx(0.1)
    assert itls(A) == pytest.approx([0.05, 0.1])
    assert tpot(A) == pytest.approx((0.3 - 0.1) / 2)
    assert ttft(B) == pytest.approx(0.2) and itls(B) == [] and tpot(B) is None
    # TPOT counts tokens, not chunks: (0.7 − 0.3) / 7.
    assert tpot(D) == pytest.approx(0.4 / 7)
    assert ttft(C) is None and tpot(C) is None


def test_run_summary():
    m = compute_metrics(RUN, 3.0, {}, ("ttft", "tpot", "itl", "e2el"), (90, 99))
    assert (m["completed"], m["failed"]) == (3, 1)
    # The failed request's tokens count nowhere.
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 12)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(47 / 3)
    assert m["request_goodput"] is None
    # Sends at 0, 0.5, 1 and 2 s: 3 gaps in 2 s.
    assert m["request_send_rate"] == pytest.approx(1.5)
    # TTFTs 100, 200, 300 ms.
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert m["p90_ttft_ms"] == pytest.approx(280)  # 200 + 0.8 × 100
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # ITLs pooled over requests: 50, 100, 100, 100, 100 ms.
    assert m["mean_itl_ms"] == pytest.approx(90)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["mean_tpot_ms"] == pytest.approx((100 + 400 / 7) / 2)
    assert m["mean_e2el_ms"] == pytest.approx(400)  # 300, 200, 700


def test_percentile_keys_and_empty_runs():
    assert set(summarize([0.001, 0.002], (50, 99.9))) == {"mean", "median", "std", "p50", "p99.9"}
    # Every request failed: zeros, same keys, no crash.
    m = compute_metrics([C], 1.0, {"ttft": 100}, ("ttft", "itl"), (99,))
    assert m["completed"] == 0 and m["request_goodput"] == 0
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    assert m["request_send_rate"] is None
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(RUN, 0.0, {}, ("ttft",), (99,))


def test_goodput():
    assert parse_goodput(["ttft:250", "tpot:80"]) == {"ttft": 250.0, "tpot": 80.0}
    assert meets_slos(B, {"tpot": 1.0})  # one token: no TPOT to miss
    assert not meets_slos(C, {})  # a failed request is never good
    # TTFT 100/200/300 ms; TPOT 100/none/57 ms; E2EL 300/200/700 ms.
    cases = {
        ("ttft:250",): 2,
        ("tpot:80",): 2,
        ("ttft:250", "tpot:80"): 1,
        ("e2el:250",): 1,
        ("ttft:1000", "tpot:1000", "e2el:1000"): 3,
    }
    for specs, good in cases.items():
        m = compute_metrics(RUN, 2.0, parse_goodput(specs), ("ttft",), (99,))
        assert m["request_goodput"] == pytest.approx(good / 2.0), specs


@pytest.mark.parametrize("spec", ["ttft", "itl:5", "ttft:fast", "ttft:-1", "ttft:inf"])
def test_bad_goodput(spec):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([spec])


def test_token_rate_series():
    # A's 3 chunks in second 0, B's 1 in second 1, D's 4 chunks of 2 tokens in second 2.
    assert token_rate_series(RUN, 3.0) == pytest.approx([3, 1, 8])
    # The last, partial second is a rate over the 0.5 s the run lasted in it.
    assert token_rate_series(RUN, 2.5) == pytest.approx([3, 1, 16])
    assert token_rate_series([C], 0.2) == [0.0]
    assert send_rate([A]) is None


def test_per_request_arrays():
    arrays = per_request_arrays(RUN)
    assert arrays["ttfts"] == pytest.approx([0.1, 0.2, None, 0.3])
    assert arrays["output_lens"] == [3, 1, 0, 8]
    assert arrays["input_lens"] == [10, 5, 7, 20]
    assert arrays["errors"] == ["", "", "HTTP 500: boom", ""]
    assert arrays["itls"][2] == [] and len(arrays["itls"][3]) == 3
