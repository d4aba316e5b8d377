"""Loading LoRA adapters into a running server: time and memory per adapter.

Starts `pagedllm serve` on the default model with `--enable-lora
--allow-runtime-lora-updating` (`--max-loras 2 --max-cpu-loras 4 --max-lora-rank 16`), writes
`--num-adapters` random rank-16 PEFT adapters of the model's projection shapes, and for each:
- `POST /v1/load_lora_adapter`: the time until the answer (the API process reads and checks
  the adapter in a worker thread; the engine is not involved);
- the first completion naming it (one token, a fresh 64-token prompt) against one on the base
  model just before: the difference is what the engine core spends reading the adapter and
  writing it into a slot;
- the engine-core process's resident memory before and after that first request.

    .venv/bin/python -m benchmarks.lora_load [--num-adapters 3] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.lora import write_adapter
from benchmarks.serve_vs_offline import start_server, stop_server
from pagedllm.config import EngineArgs
from pagedllm.core.engine_config import load_engine_config
from pagedllm.lora.peft import projection_shapes
from pagedllm.utils import free_port

SERVER_FLAGS = ["--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2"]
SERVER_FLAGS += ["--max-cpu-loras", "4", "--max-lora-rank", "16", "--max-num-seqs", "8"]


def post(port: int, route: str, body: dict) -> tuple[float, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = reply.read()
    return time.perf_counter() - started, answer


def core_rss(server) -> int:
    """Resident bytes of the engine-core process (the server's largest child)."""
    children = psutil.Process(server.pid).children(recursive=True)
    return max(child.memory_info().rss for child in children)


def completion_seconds(port: int, model: str, first_token: int) -> float:
    prompt = [first_token + i for i in range(64)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return post(port, "/v1/completions", body)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-adapters", type=int, default=3)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    _, _, config = load_engine_config(EngineArgs(), log=False)
    shapes = projection_shapes(config.model_config)
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-lora-load-"))
    port = free_port()
    server, _ = start_server(port, workdir / "server.log", tuple(SERVER_FLAGS))
    results = []
    try:
        served = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())
        base = served["data"][0]["id"]
        completion_seconds(port, base, 1000)  # warm-up
        for i in range(args.num_adapters):
            path = write_adapter(workdir / f"a{i}", shapes, 16, seed=i)
            load_seconds, _ = post(
                port, "/v1/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": str(path)}
            )
            base_seconds = completion_seconds(port, base, 2000 + 100 * i)
            rss_before = core_rss(server)
            first_seconds = completion_seconds(port, f"a{i}", 3000 + 100 * i)
            again_seconds = completion_seconds(port, f"a{i}", 4000 + 100 * i)
            results.append(
                {
                    "load_endpoint_ms": 1e3 * load_seconds,
                    "base_request_ms": 1e3 * base_seconds,
                    "first_request_ms": 1e3 * first_seconds,
                    "second_request_ms": 1e3 * again_seconds,
                    "core_rss_growth_mib": (core_rss(server) - rss_before) / 2**20,
                }
            )
            print(f"adapter a{i}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[-1].items()))
    finally:
        stop_server(server)
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
