"""The API process's CPU per streamed token and the server's output tokens/s at saturation,
before and after a change, in alternating rounds of one sitting.

Each round starts `pagedllm serve` (default model, default flags) from the earlier tree
(`--before-tree`, a worktree of the earlier commit; its package runs on this tree's
virtualenv) and then from this one, drives each with the same `pagedllm bench serve` load
(`--num-prompts` random prompts of `--input-len` tokens, `--output-len` streamed tokens each,
EOS ignored, `--max-concurrency` in flight: enough to keep both cores busy), and reads the API
process's own CPU seconds (psutil, its engine-core child not included) over the load. What
that CPU pays for: HTTP parsing, detokenizing, the stream's JSON.

    .venv/bin/python -m benchmarks.api_cpu_pairs --before-tree /tmp/before [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from benchmarks.serve_vs_offline import BIN, api_cpu_seconds, start_server, stop_server
from pagedllm.utils import free_port

THIS_TREE = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", required=True, help="a checkout of the earlier commit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=48)
    parser.add_argument("--out-dir", default="benchmarks/out/api_cpu_pairs")
    return parser.parse_args()


def load_command(args: argparse.Namespace, port: int, output_json: Path) -> list[str]:
    return [
        str(BIN / "pagedllm"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--dataset-seed", "0", "--max-concurrency", str(args.max_concurrency),
        "--ignore-eos", "--temperature", "1.0", "--prompt-format", "token-ids",
        "--disable-tqdm", "--output-json", str(output_json),
    ]  # fmt: skip


def measure(args: argparse.Namespace, side: str, tree: Path, out: Path, round_: int) -> dict:
    """One server from `tree` under the load; the load's client always runs from this tree."""
    port = free_port()
    os.environ["PYTHONPATH"] = str(tree)  # the server imports `tree`'s package
    server, startup_s = start_server(port, out / f"{side}_{round_}.log")
    os.environ["PYTHONPATH"] = str(THIS_TREE)
    load_average = os.getloadavg()
    cpu_before = api_cpu_seconds(server)
    served_json = out / f"{side}_{round_}.json"
    subprocess.run(load_command(args, port, served_json), check=True)
    api_cpu_s = api_cpu_seconds(server) - cpu_before
    stop_server(server)
    served = json.loads(served_json.read_text())
    tokens = served["total_output_tokens"]
    return {
        "round": round_,
        "side": side,
        "load_average_before": [round(x, 2) for x in load_average],
        "startup_s": round(startup_s, 2),
        "output_tokens_per_s": round(served["output_throughput"], 2),
        "total_output_tokens": tokens,
        "api_process_cpu_s": round(api_cpu_s, 2),
        "api_process_cpu_ms_per_output_token": round(1000 * api_cpu_s / tokens, 3),
    }


def main() -> None:
    args = parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trees = {"before": Path(args.before_tree).resolve(), "after": THIS_TREE}
    rows = []
    for round_ in range(args.rounds):
        for side, tree in trees.items():
            rows.append(measure(args, side, tree, out, round_))
            print(json.dumps(rows[-1]), flush=True)
    (out / "summary.json").write_text(json.dumps({"config": vars(args), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
