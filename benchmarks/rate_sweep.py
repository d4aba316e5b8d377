"""The highest Poisson arrival rate at which p99 TTFT stays under a bound, per scheduling
policy, for two tenants sharing one `pagedllm serve`.

For each policy (`fcfs`, `fair`) one server starts with two API keys. Tenant A sends
`--heavy-share` of the requests (long answers), tenant B the rest (short answers); the
arrivals of both together are one Poisson process at the rate under test. Rates rise
through `--rates` until p99 TTFT over all requests passes `--ttft-bound`; the last rate that
stayed under it is the policy's answer. Each rate's TTFT percentiles, per tenant as well,
go into the JSON. Each server first idles `--settle` seconds (its KV pool is faulted in on
one core after start-up) and serves a few warm-up requests.

    .venv/bin/python -m benchmarks.rate_sweep [--rates 0.1 0.2 0.3 0.5 0.75 1 --requests 60
        --policies fcfs fair --output-json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks.tenant_server import prompt_text, report_policies, start_tenant_server
from pagedllm.entrypoints.bench.serve import ServeBenchConfig, arrival_offsets, send_request
from pagedllm.entrypoints.bench.serve_metrics import RequestOutcome, ttft

KEYS = {"tenant-a": "sk-rate-a", "tenant-b": "sk-rate-b"}
WARMUP_REQUESTS = 8


def p99_ms(outcomes: list[RequestOutcome]) -> float | None:
    values = [v for o in outcomes if (v := ttft(o)) is not None]
    return round(float(np.percentile(values, 99)) * 1000, 1) if values else None


async def run_rate(
    base_url: str, rate: float, args: argparse.Namespace, num_requests: int | None = None
) -> dict:
    num_requests = num_requests or args.requests
    # Fresh prompts at every rate: a prompt seen at an earlier rate would be a prefix-cache
    # hit, and its TTFT no prefill at all.
    rng = random.Random(f"{args.seed}:{rate}")
    tenants = ["tenant-a" if rng.random() < args.heavy_share else "tenant-b"
               for _ in range(num_requests)]  # fmt: skip
    configs = {
        name: ServeBenchConfig(base_url=base_url, endpoint="/v1/completions",
                               api_key=key, ignore_eos=True, disable_tqdm=True)
        for name, key in KEYS.items()
    }  # fmt: skip
    offsets = arrival_offsets(num_requests, rate, 1.0, args.seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        async def one(tenant: str, offset: float) -> RequestOutcome:
            await asyncio.sleep(max(0.0, offset - clock()))
            long = tenant == "tenant-a"
            payload = {
                "model": args.model,
                "prompt": prompt_text(rng, args.input_words),
                "max_tokens": args.heavy_output if long else args.light_output,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return await send_request(session, configs[tenant], payload, 0, clock)

        outcomes = await asyncio.gather(*(one(t, o) for t, o in zip(tenants, offsets, strict=True)))
    by_tenant = {
        name: [o for o, t in zip(outcomes, tenants, strict=True) if t == name] for name in KEYS
    }
    return {
        "rate": rate,
        "failed": sum(not o.success for o in outcomes),
        "p99_ttft_ms": p99_ms(list(outcomes)),
        "p50_ttft_ms": round(float(np.median([ttft(o) or 0 for o in outcomes])) * 1000, 1),
        **{f"p99_ttft_ms_{name}": p99_ms(group) for name, group in by_tenant.items()},
    }


def sweep(policy: str, args: argparse.Namespace, out_dir: Path) -> dict:
    server = start_tenant_server(policy, KEYS, out_dir, ["--scheduling-policy", policy])
    steps, best = [], None
    try:
        # A server fresh from start-up still faults its KV pool in on one core: let it
        # settle, then run a few requests through it before the first measured rate.
        time.sleep(args.settle)
        asyncio.run(run_rate(server.base_url, math.inf, args, num_requests=WARMUP_REQUESTS))
        for rate in args.rates:
            step = asyncio.run(run_rate(server.base_url, rate, args))
            print(json.dumps({"policy": policy, **step}), flush=True)
            steps.append(step)
            p99 = step["p99_ttft_ms"]
            if step["failed"] or p99 is None or p99 > args.ttft_bound * 1000:
                break
            best = rate
    finally:
        server.stop()
    return {"policy": policy, "highest_rate_under_bound": best, "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 0.75, 1])
    parser.add_argument("--settle", type=float, default=30.0, help="idle seconds after start")
    parser.add_argument("--policies", nargs="+", default=["fcfs", "fair"])
    parser.add_argument("--requests", type=int, default=60, help="requests per rate")
    parser.add_argument("--heavy-share", type=float, default=0.75, help="tenant A's share")
    parser.add_argument("--input-words", type=int, default=100, help="prompt length in words")
    parser.add_argument("--heavy-output", type=int, default=64, help="tenant A's max_tokens")
    parser.add_argument("--light-output", type=int, default=16, help="tenant B's max_tokens")
    parser.add_argument("--ttft-bound", type=float, default=2.0, help="p99 TTFT bound (s)")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    args.model = args.model or "SmolLM2-135M-Instruct"
    return report_policies(args, sweep, Path("benchmarks/out/rate_sweep"))


if __name__ == "__main__":
    sys.exit(main())
