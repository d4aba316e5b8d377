"""A soak of mixed traffic against `pagedllm serve` while its engine core is killed now and
then: does it stay up, answer everyone, and hold its memory and file descriptors?

Starts the server with three tenants (keys file) and an admin key, `--scheduling-policy fair`,
`--restart-on-engine-failure`, runtime LoRA updating (`--lora-path-root` a folder of random
adapters of the default model), a Responses store and the disk KV tier (`--kv-offload-dir`
under the out dir, emptied first). Then, for `--duration` seconds:
- `--concurrency` clients send a weighted mix (`soak_traffic.py`): streaming chat, plain
  completions, n > 1, structured output, tool calls, streams the client aborts, requests whose
  client disconnects, bad requests, prompts sharing long prefixes (the disk tier's traffic),
  requests naming runtime adapters, stored responses and their follow-ups;
- the admin loads and unloads adapters every `--lora-every` seconds (`soak_loras.py`);
- the engine core is SIGKILLed every `--kill-every` seconds (`soak_chaos.py`), and the time
  until /health answers with a new core is recorded.

Requests are classed completed / refused / cancelled / failed (`soak_traffic.py`), and a
failure by the server's fault that was in flight at a kill is `killed_in_flight`
(`soak_chaos.py`). RSS: the API process is read every `--api-sample-every` seconds; its
growth is the end (after settling) against the reading `--api-baseline-after` seconds into
the traffic, once its thread pools, allocator arenas, the dashboard's 300 s window and the
adapters' first loads have reached their working size at full concurrency (the growth from
the single-request warm-up is reported beside it, with the whole series). The engine core
(replaced at each kill): each core's RSS outside its KV pool (soak_memory.py: the pool is
faulted in as it is used, which RSS would count) at a fixed age of serving, the last
against the first; plain RSS is reported beside it. The goal: no failed request, no 5xx but
the kills' in-flight ones and the 503 refusals (Retry-After) while the engine restarts
(503s outside a restart are counted apart: overload), a restart per kill, RSS growth <= 5%
for the API process from its baseline reading and RSS-outside-the-pool growth <= 5% for
the core.

    .venv/bin/python -m benchmarks.soak [--duration 1800 --kill-every 300 --concurrency 8
        --output-json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from benchmarks.peers.servers import Server
from benchmarks.soak_chaos import Chaos, final_class, usage
from benchmarks.soak_loras import LORA_FLAGS, AdapterPool, write_adapters
from benchmarks.soak_traffic import ADMIN_KEY, KEYS, Soak
from benchmarks.tenant_server import start_tenant_server
from pagedllm.runner.kv_pool_ranges import RANGES_DIR_ENV

# After the run: how long the server may take to go idle (blocks back, queues empty).
SETTLE_S = 10.0
NUM_ADAPTERS = 4
GOAL_GROWTH_PERCENT = 5.0
WARM_UP = ("plain", "structured", "tools", "shared_prefix", "lora", "responses")
CLASSES = ("completed", "refused", "cancelled", "killed_in_flight", "failed")


def scrape(base_url: str) -> str:
    request = urllib.request.Request(
        base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read().decode()


def metric_sums(text: str, name: str, by_label: str | None = None) -> dict[str, float]:
    """The sum over series of `pagedllm:<name>`, per value of `by_label` (else under "")."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith((f"pagedllm:{name}{{", f"pagedllm:{name} ")):
            continue
        key = ""
        if by_label is not None and f'{by_label}="' in line:
            key = line.split(f'{by_label}="', 1)[1].split('"', 1)[0]
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def growth_percent(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {key: round(100.0 * (after[key] - value) / value, 2) for key, value in before.items()}


async def warm_up(soak: Soak) -> None:
    async with aiohttp.ClientSession() as session:
        for kind in WARM_UP:
            await soak.send(session, "warm_up", getattr(soak, kind))


async def sample_api(
    api: psutil.Process, started: float, deadline: float, every_s: float, series: list
) -> None:
    """[seconds into the traffic, RSS] every `every_s` until the deadline."""
    while time.monotonic() < deadline:
        series.append([round(time.monotonic() - started), api.memory_info().rss])
        await asyncio.sleep(min(every_s, max(0.0, deadline - time.monotonic())))


async def run(soak: Soak, pool: AdapterPool, chaos: Chaos, args, api_series: list) -> float:
    started = time.monotonic()
    deadline = started + args.duration
    chaos.watch(started)
    api = psutil.Process(chaos.api_pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(
            *(soak.client(session, deadline) for _ in range(args.concurrency)),
            pool.churn(deadline, args.lora_every, args.seed),
            chaos.kill_loop(started, deadline),
            chaos.monitor(deadline),
            sample_api(api, started, deadline, args.api_sample_every, api_series),
        )
    return time.monotonic() - started


def baseline_rss(series: list[list[int]], after_s: float) -> int:
    """The first reading at least `after_s` into the traffic (the last one if none is)."""
    return next((rss for at, rss in series if at >= after_s), series[-1][1])


def restart_windows(chaos: Chaos) -> list[tuple[float, float]]:
    """From each kill until the server served again (to the end of the run if it never did)."""
    return [
        (kill, kill + (took if took is not None else float("inf")))
        for kill, took in zip(chaos.kills, chaos.recoveries_s, strict=False)
    ]


def classify(soak: Soak, kills: list[float], windows: list[tuple[float, float]]) -> dict:
    by_kind: dict[str, Counter[str]] = {}
    statuses: Counter[str] = Counter()
    failures, num_5xx, num_503_outside = [], 0, 0
    for attempt in soak.attempts:
        name = final_class(attempt, kills)
        by_kind.setdefault(attempt.kind, Counter())[name] += 1
        status = attempt.judged.status
        statuses[str(status)] += 1
        if status == 503:  # a refusal (with Retry-After): the engine restarting, or overload
            restarting = any(start <= attempt.ended <= end + 1.0 for start, end in windows)
            num_503_outside += not restarting
        elif status is not None and status >= 500 and name != "killed_in_flight":
            num_5xx += 1
        if name == "failed" and len(failures) < 20:
            failures.append(f"{attempt.kind}: {attempt.judged.detail[:300]}")
    totals: Counter[str] = Counter()
    for counts in by_kind.values():
        totals.update(counts)
    return {
        "sent": sum(totals.values()),
        **{name: totals[name] for name in CLASSES},
        "num_5xx_not_503_not_killed_in_flight": num_5xx,
        "num_503_outside_restarts": num_503_outside,
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "http_statuses": dict(sorted(statuses.items())),
        "failures": failures,
    }


def server_flags(args, out_dir: Path) -> list[str]:
    tier = out_dir / "kv-tier"
    shutil.rmtree(tier, ignore_errors=True)
    adapters = out_dir / "adapters"
    return [
        "--scheduling-policy", "fair", "--restart-on-engine-failure",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--kv-cache-memory", args.kv_cache_memory, "--admin-api-key", ADMIN_KEY,
        *LORA_FLAGS, "--lora-path-root", str(adapters),
        "--responses-store-size", "256", "--kv-offload-dir", str(tier),
    ]  # fmt: skip


def soak_report(server: Server, args, adapter_paths: list[Path]) -> dict:
    api = psutil.Process(server.process.pid)
    pool = AdapterPool(server.base_url, ADMIN_KEY, adapter_paths)
    soak = Soak(server.base_url, args.seed, pool)
    ranges_dir = Path(os.environ[RANGES_DIR_ENV])
    chaos = Chaos(api.pid, server.base_url, args.kill_every, args.core_sample_age, ranges_dir)
    asyncio.run(pool_first_load(pool, args.seed))
    asyncio.run(warm_up(soak))
    warm_up_s = {
        kind: round(done.ended - done.started, 1)
        for kind, done in zip(WARM_UP, soak.attempts, strict=True)
    }
    time.sleep(2.0)
    api_before = usage(api)
    api_series: list[list[int]] = []
    seconds = asyncio.run(run(soak, pool, chaos, args, api_series))
    time.sleep(SETTLE_S)
    chaos.read_core()
    api_after = usage(api)
    metrics = scrape(server.base_url)
    counts = classify(soak, chaos.kills, restart_windows(chaos))
    api_growth = growth_percent(api_before, api_after)
    api_baseline = {"rss": baseline_rss(api_series, args.api_baseline_after)}
    api_steady_growth = growth_percent(api_baseline, api_after)
    core = chaos.core_growth()
    restarts = sum(metric_sums(metrics, "engine_restarts_total").values())
    return {
        "duration_s": round(seconds, 1),
        "warm_up_s": warm_up_s,
        "concurrency": args.concurrency,
        "kill_every_s": args.kill_every,
        **counts,
        "kills": len(chaos.kills),
        "kill_times_s": [round(kill - chaos.traffic_started, 1) for kill in chaos.kills],
        "recovery_s": chaos.recoveries_s,
        "engine_restarts": restarts,
        "loras": pool.report(),
        "kv_tier_events": metric_sums(metrics, "kv_tier_events_total", "event"),
        "kv_cache_usage_at_end": sum(metric_sums(metrics, "kv_cache_usage_perc").values()),
        "api": {
            "before": api_before,
            "after": api_after,
            "growth_percent": api_growth,
            "baseline_after_s": args.api_baseline_after,
            "baseline": api_baseline,
            "growth_from_baseline_percent": api_steady_growth,
            "rss_series": api_series,
        },
        "engine_core": core,
        "goal": {
            "no_failed": counts["failed"] == 0 and not pool.admin_failures,
            "no_other_5xx": counts["num_5xx_not_503_not_killed_in_flight"] == 0,
            "restart_per_kill": restarts == len(chaos.kills) and None not in chaos.recoveries_s,
            "api_rss_growth_ok": api_steady_growth["rss"] <= GOAL_GROWTH_PERCENT,
            "core_rss_growth_ok": core.get("growth_percent", 0.0) <= GOAL_GROWTH_PERCENT,
        },
    }


async def pool_first_load(pool: AdapterPool, seed: int) -> None:
    async with aiohttp.ClientSession() as session:
        await pool.load(session, random.Random(seed))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills")
    parser.add_argument("--lora-every", type=float, default=20.0, help="seconds between loads")
    parser.add_argument(
        "--core-sample-age",
        type=float,
        default=None,
        help="seconds of serving at which each engine core's RSS is read (default: "
        "min(120, kill-every / 2))",
    )
    parser.add_argument(
        "--api-sample-every", type=float, default=60.0, help="seconds between API RSS readings"
    )
    parser.add_argument(
        "--api-baseline-after",
        type=float,
        default=300.0,
        help="seconds into the traffic of the API RSS reading growth is measured from",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="the server's KV pool; small enough to be faulted in whole before the first reading",
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--out-dir", default="benchmarks/out/soak", help="server log, keys, tier")
    args = parser.parse_args()
    if args.core_sample_age is None:
        args.core_sample_age = min(120.0, args.kill_every / 2)
    return args


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out_dir).resolve()
    adapter_paths = write_adapters(out_dir / "adapters", NUM_ADAPTERS)
    # Each core publishes its KV pool's ranges there (the server inherits the environment).
    shutil.rmtree(out_dir / "kv-pool", ignore_errors=True)
    os.environ[RANGES_DIR_ENV] = str(out_dir / "kv-pool")
    server = start_tenant_server("soak", KEYS, out_dir, server_flags(args, out_dir))
    try:
        report = soak_report(server, args, adapter_paths)
    finally:
        server.stop()
    report["server_exit_code"] = server.process.returncode
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0 if all(report["goal"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
