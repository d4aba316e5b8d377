"""The one workload every engine runs, and the load generator's command line.

The prompts are written once to a JSONL file (`prompt_token_ids`, `output_len` per line,
from `pagedllm.entrypoints.bench.datasets`' random dataset, seed 0), and every engine reads
that file: the offline runners directly, the servers through `pagedllm bench serve
--dataset-name file --prompt-format token-ids`, so each engine sees exactly the same token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.common import OUR_BIN

VOCAB_SIZE = 49152  # SmolLM2's
SAMPLING_TEMPERATURE = "1.0"  # as `pagedllm bench throughput` samples
PERCENTILES = "50,90,99"


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    path: Path

    def describe(self) -> str:
        return (
            f"{self.num_prompts} random prompts × {self.input_len} tokens in, "
            f"{self.output_len} out, EOS ignored"
        )


def write_workload(workload: Workload, seed: int = 0) -> None:
    from pagedllm.entrypoints.bench.datasets import DatasetConfig, random_dataset

    config = DatasetConfig(
        name="random", num_prompts=workload.num_prompts, input_len=workload.input_len,
        output_len=workload.output_len, seed=seed,
    )  # fmt: skip
    requests = random_dataset(config, VOCAB_SIZE, tokenizer=None)
    workload.path.parent.mkdir(parents=True, exist_ok=True)
    with open(workload.path, "w") as f:
        for request in requests:
            record = {"prompt_token_ids": request.prompt_token_ids}
            record["output_len"] = request.output_len
            f.write(json.dumps(record) + "\n")


def bench_serve_command(
    base_url: str, workload: Workload, rate: str, out_json: Path, plot: Path | None = None
) -> list[str]:
    """`pagedllm bench serve` on the workload at `rate` requests/s ("inf": all at once)."""
    command = [
        str(OUR_BIN / "pagedllm"), "bench", "serve", "--base-url", base_url,
        "--dataset-name", "file", "--dataset-path", str(workload.path),
        "--num-prompts", str(workload.num_prompts), "--output-len", str(workload.output_len),
        "--request-rate", rate, "--ignore-eos", "--temperature", SAMPLING_TEMPERATURE,
        "--prompt-format", "token-ids", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", PERCENTILES, "--disable-tqdm", "--output-json", str(out_json),
    ]  # fmt: skip
    return [*command, "--plot", str(plot)] if plot else command


def serve_summary(report: dict[str, Any]) -> dict[str, Any]:
    """A `bench serve` report without its per-request arrays, plus its first error."""
    summary = {k: v for k, v in report.items() if not isinstance(v, list)}
    summary["first_error"] = next((e for e in report.get("errors", []) if e), None)
    return summary


def as_throughput(report: dict[str, Any]) -> dict[str, Any]:
    """A `bench serve` run at rate inf in `pagedllm bench throughput`'s keys."""
    seconds = report["duration"]
    num_requests = report["completed"]
    return {
        "elapsed_s": round(seconds, 3),
        "num_requests": num_requests,
        "failed_requests": report["failed"],
        "num_input_tokens": report["total_input_tokens"],
        "num_output_tokens": report["total_output_tokens"],
        "requests_per_s": round(num_requests / seconds, 3),
        "output_tokens_per_s": round(report["total_output_tokens"] / seconds, 1),
        "total_tokens_per_s": round(
            (report["total_input_tokens"] + report["total_output_tokens"]) / seconds, 1
        ),
        "first_error": next((e for e in report.get("errors", []) if e), None),
    }
