"""Tenant B's time to first token while tenant A floods one `pagedllm serve`, per scheduling
policy (issue 22's fair-share check, over HTTP and in wall-clock time).

For each policy one server starts with two API keys (two tenants). First B alone sends its
`--short` requests at once (the idle baseline on that server); then A sends `--flood` long
requests at once, and `--head-start` seconds later B sends its requests again. B's TTFTs are
measured; A's requests still running when B's last one finishes are cancelled (the server
aborts them). The JSON has B's median and p90 TTFT idle and under the flood, and their ratio.

    .venv/bin/python -m benchmarks.fair_share [--policies fcfs fair --flood 200 --short 10
        --max-num-seqs 32 --output-json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.tenant_server import prompt_text, report_policies, start_tenant_server
from pagedllm.entrypoints.bench.serve import ServeBenchConfig, send_request
from pagedllm.entrypoints.bench.serve_metrics import RequestOutcome, ttft

KEYS = {"tenant-a": "sk-fair-a", "tenant-b": "sk-fair-b"}


def summary(outcomes: list[RequestOutcome]) -> dict:
    values = sorted(v for o in outcomes if (v := ttft(o)) is not None)
    if not values:
        return {"failed": len(outcomes)}
    return {
        "failed": sum(not o.success for o in outcomes),
        "median_ttft_ms": round(statistics.median(values) * 1000, 1),
        "p90_ttft_ms": round(values[math.ceil(0.9 * len(values)) - 1] * 1000, 1),  # nearest rank
    }


async def run_policy(base_url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    configs = {
        name: ServeBenchConfig(base_url=base_url, endpoint="/v1/completions",
                               api_key=key, ignore_eos=True, disable_tqdm=True)
        for name, key in KEYS.items()
    }  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=0)  # the flood's requests all at once
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if args.model is None:  # the server's first served model
            headers = {"Authorization": f"Bearer {KEYS['tenant-b']}"}
            async with session.get(base_url + "/v1/models", headers=headers) as reply:
                args.model = (await reply.json())["data"][0]["id"]
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        def send(tenant: str, words: int, max_tokens: int):
            payload = {
                "model": args.model,
                "prompt": prompt_text(rng, words),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
            }
            return send_request(session, configs[tenant], payload, 0, clock)

        def short_requests():
            return [
                send("tenant-b", args.short_words, args.short_output) for _ in range(args.short)
            ]

        idle = await asyncio.gather(*short_requests())
        flood = [
            asyncio.create_task(send("tenant-a", args.flood_words, args.flood_output))
            for _ in range(args.flood)
        ]
        await asyncio.sleep(args.head_start)
        loaded = await asyncio.gather(*short_requests())
        flood_running = sum(not task.done() for task in flood)
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    idle_summary, loaded_summary = summary(list(idle)), summary(list(loaded))
    ratio = None
    if "median_ttft_ms" in idle_summary and "median_ttft_ms" in loaded_summary:
        ratio = round(loaded_summary["median_ttft_ms"] / idle_summary["median_ttft_ms"], 2)
    return {
        "b_idle": idle_summary,
        "b_under_flood": loaded_summary,
        "median_ratio": ratio,
        "flood_requests_still_running": flood_running,
    }


def measure(policy: str, args: argparse.Namespace, out_dir: Path) -> dict:
    flags = ["--scheduling-policy", policy]
    if args.server_model:
        flags += ["--model", args.server_model]
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) is not None:
            flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    server = start_tenant_server(policy, KEYS, out_dir, flags)
    try:
        result = asyncio.run(run_policy(server.base_url, args))
    finally:
        server.stop()
    print(json.dumps({"policy": policy, **result}), flush=True)
    return {"policy": policy, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["fcfs", "fair"])
    parser.add_argument("--flood", type=int, default=200, help="tenant A's requests")
    parser.add_argument("--short", type=int, default=10, help="tenant B's requests")
    parser.add_argument("--flood-words", type=int, default=200, help="A's prompt length, words")
    parser.add_argument("--flood-output", type=int, default=128, help="A's max_tokens")
    parser.add_argument("--short-words", type=int, default=20, help="B's prompt length, words")
    parser.add_argument("--short-output", type=int, default=8, help="B's max_tokens")
    parser.add_argument(
        "--head-start", type=float, default=3.0, help="seconds A floods before B sends"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the server's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's")
    parser.add_argument(
        "--server-model", default=None, help="the server's --model (default: its own default)"
    )
    parser.add_argument(
        "--model", default=None, help="model name in the requests (default: the server's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    return report_policies(args, measure, Path("benchmarks/out/fair_share"))


if __name__ == "__main__":
    sys.exit(main())
