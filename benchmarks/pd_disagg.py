"""One mixed server against a prefill + decode pair behind `pagedllm proxy`, on the same
cores (default model, fp32): TTFT and TPOT under load, and the KV transfer time per request.

- "mixed": one `pagedllm serve` on every core of `--cores` (2 threads).
- "pd": a prefill server (kv_producer) on the first core and a decode server (kv_consumer)
  on the second (1 thread each), with the proxy in front (on any core: it only relays).

Both get the same load: `pagedllm bench serve` with `--num-prompts` random prompts of
`--input-len` tokens and `--output-len` output tokens (EOS ignored) at `--request-rate`
requests/s. The transfer time is the prefill server's total send time over its requests
(`pagedllm:kv_tier_events_total{event="send_seconds"}` / `{event="sent_requests"}`).

    .venv/bin/python -m benchmarks.pd_disagg [--num-prompts 32] [--input-len 512]
        [--output-len 64] [--request-rate 1] [--cores 0,1] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.compare import machine
from pagedllm.utils import free_port

BIN = Path(sys.executable).parent
OUT = Path(__file__).parent / "out"


def launch(command: list[str], cores: str, threads: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "w") as handle:
        return subprocess.Popen(
            ["taskset", "-c", cores, *command], stdout=handle, stderr=subprocess.STDOUT, env=env
        )


def serve(port: int, cores: str, threads: int, log: Path, flags: list[str]) -> subprocess.Popen:
    command = [str(BIN / "pagedllm"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    return launch([*command, "--disable-uvicorn-access-log", *flags], cores, threads, log)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def metric(url: str, name: str, event: str | None = None) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(f"pagedllm:{name}") and (event is None or f'event="{event}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def bench(url: str, args: argparse.Namespace, name: str) -> dict:
    report = OUT / f"pd_{name}.json"
    subprocess.run(
        [str(BIN / "pagedllm"), "bench", "serve", "--base-url", url,
         "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
         "--input-len", str(args.input_len), "--output-len", str(args.output_len),
         "--dataset-seed", "0", "--request-rate", str(args.request_rate), "--ignore-eos",
         "--prompt-format", "token-ids", "--metric-percentiles", "50,90,99",
         "--disable-tqdm", "--output-json", str(report)],
        check=True,
    )  # fmt: skip
    result = json.loads(report.read_text())
    keys = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
            "p99_tpot_ms", "output_throughput", "request_throughput", "duration")  # fmt: skip
    return {k: result.get(k) for k in keys}


def run_mixed(args: argparse.Namespace, flags: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = serve(port, args.cores, len(args.cores.split(",")), OUT / "pd_mixed.log", flags)
    try:
        wait_healthy(url, server)
        return bench(url, args, "mixed")
    finally:
        server.terminate()
        server.wait(120)


def run_pair(args: argparse.Namespace, flags: list[str]) -> dict:
    prefill_core, decode_core = args.cores.split(",")[:2]
    kv_port, prefill_port, decode_port, proxy_port = (free_port() for _ in range(4))
    consumer = {"kv_role": "kv_consumer", "kv_port": kv_port}
    producer = {
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"peer": f"127.0.0.1:{kv_port}"},
    }
    decode = serve(decode_port, decode_core, 1, OUT / "pd_decode.log",
                   [*flags, "--kv-transfer-config", json.dumps(consumer)])  # fmt: skip
    prefill = serve(prefill_port, prefill_core, 1, OUT / "pd_prefill.log",
                    [*flags, "--kv-transfer-config", json.dumps(producer)])  # fmt: skip
    prefill_url, decode_url = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    proxy = launch(
        [str(BIN / "pagedllm"), "proxy", "--prefill", prefill_url, "--decode", decode_url,
         "--host", "127.0.0.1", "--port", str(proxy_port)],
        args.cores, 1, OUT / "pd_proxy.log",
    )  # fmt: skip
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    try:
        for url, process in ((decode_url, decode), (prefill_url, prefill), (proxy_url, proxy)):
            wait_healthy(url, process)
        result = bench(proxy_url, args, "pair")
        sent = metric(prefill_url, "kv_tier_events_total", "sent_requests")
        seconds = metric(prefill_url, "kv_tier_events_total", "send_seconds")
        result["transfer_ms_per_request"] = round(1000 * seconds / sent, 2) if sent else None
        result["failed_sends"] = metric(prefill_url, "kv_tier_events_total", "failed_sends")
        result["decode_prompt_tokens_computed"] = metric(decode_url, "prompt_tokens_computed_total")
        return result
    finally:
        for process in (proxy, prefill, decode):
            process.terminate()
            process.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--configs", default="mixed,pd")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    flags = ["--max-model-len", "2048", "--kv-cache-memory", "1GiB", "--disable-log-stats"]
    results = {}
    for config in args.configs.split(","):
        results[config] = run_mixed(args, flags) if config == "mixed" else run_pair(args, flags)
        print(config, json.dumps(results[config]))
    report = {"machine": machine(), "args": vars(args) | {"output_json": None}, **results}
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
