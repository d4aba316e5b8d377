"""benchmarks.soak: a failure is the kill's in-flight casualty only when the server failed it
around a kill; a 404 on an adapter is allowed only after that adapter's unload."""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak import classify
from benchmarks.soak_chaos import KILL_NOTICE_S, final_class
from benchmarks.soak_loras import AdapterPool
from benchmarks.soak_traffic import Attempt, Judged, Soak, failed

KILLS = [100.0, 200.0]


def attempt(judged: Judged, started: float, ended: float) -> Attempt:
    return Attempt("plain", judged, started, ended)


def test_a_server_failure_spanning_a_kill_is_killed_in_flight():
    assert final_class(attempt(failed("HTTP 500", 500), 99.0, 101.0), KILLS) == "killed_in_flight"
    stream_error = failed("error event", 200, server_error=True)
    assert final_class(attempt(stream_error, 199.5, 200.2), KILLS) == "killed_in_flight"
    # Sent just after the kill, before the server noticed the core was gone.
    late = attempt(failed("HTTP 500", 500), 100.0 + KILL_NOTICE_S / 2, 101.5)
    assert final_class(late, KILLS) == "killed_in_flight"


def test_other_failures_stay_failed():
    # A 5xx far from any kill.
    assert final_class(attempt(failed("HTTP 500", 500), 150.0, 151.0), KILLS) == "failed"
    # Ended before the kill.
    assert final_class(attempt(failed("HTTP 500", 500), 90.0, 99.9), KILLS) == "failed"
    # Sent well after the kill (the server should have answered 503 or served it).
    late = attempt(failed("HTTP 500", 500), 100.0 + 2 * KILL_NOTICE_S, 105.0)
    assert final_class(late, KILLS) == "failed"
    # Not the server's fault: a good request refused, an incomplete answer.
    assert final_class(attempt(failed("HTTP 400", 400), 99.0, 101.0), KILLS) == "failed"
    assert final_class(attempt(failed("incomplete", 200), 99.0, 101.0), KILLS) == "failed"


def test_other_classes_are_kept():
    for outcome in ("completed", "refused", "cancelled"):
        assert final_class(attempt(Judged(outcome, status=200), 99.0, 101.0), KILLS) == outcome


def test_an_adapter_counts_as_unloaded_only_after_its_unload():
    pool = AdapterPool("http://127.0.0.1:1", "key", [Path("adapter0")])
    pool.unloaded_at["adapter0-1"] = 50.0
    assert pool.unloaded_since("adapter0-1", sent_at=49.0)
    assert not pool.unloaded_since("adapter0-1", sent_at=51.0)
    assert not pool.unloaded_since("adapter0-2", sent_at=10.0)


def test_the_report_counts_5xx_apart_from_kills_and_restart_refusals():
    soak = Soak("http://127.0.0.1:1", seed=0)
    soak.attempts = [
        attempt(failed("HTTP 500", 500), 99.0, 101.0),  # the kill's in-flight casualty
        attempt(Judged("refused", status=503), 110.0, 110.1),  # while restarting
        attempt(Judged("refused", status=503), 150.0, 150.1),  # overload, after recovery
        attempt(failed("HTTP 500", 500), 150.0, 151.0),  # a real failure
        attempt(Judged("completed", status=200), 150.0, 151.0),
    ]
    report = classify(soak, kills=[100.0], windows=[(100.0, 130.0)])
    assert report["killed_in_flight"] == 1
    assert report["failed"] == 1
    assert report["refused"] == 2
    assert report["num_5xx_not_503_not_killed_in_flight"] == 1
    assert report["num_503_outside_restarts"] == 1
    assert report["by_kind"] == {
        "plain": {"killed_in_flight": 1, "refused": 2, "failed": 1, "completed": 1}
    }
