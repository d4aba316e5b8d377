"""Decode steps as two half-batch forwards, one OpenMP thread each (2026-11-25, not kept).

The idea: decode attention is bound by memory and the matmuls by arithmetic, so two halves of
the batch running side by side on the two cores, out of phase, might overlap one's attention
with the other's matmuls. One process, the default model, `--batch` sequences decoding
after `--input-len`-token prompts; decode steps alternate between the engine's one forward
(2 threads) and the split (two Python threads, `torch.set_num_threads(1)` in each, the second
half started `--delay-ms` later to put the halves out of phase). Logits, sampling and the
rest of the step are the engine's own in both.

    .venv/bin/python benchmarks/results/decode-memory-2026-11-25/split_decode.py \
        --batch 256 --steps 16 --populate-kv-cache [--delay-ms 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import step_breakdown

from pagedllm import LLM, SamplingParams
from pagedllm.bench.datasets import DatasetConfig, random_dataset
from pagedllm.ops.attention import AttentionMetadata
from pagedllm.worker.model_runner import ModelRunner


def half_metadata(metadata: AttentionMetadata, begin: int, end: int) -> AttentionMetadata:
    """Decode-only layout of requests begin..end (one token each)."""
    count = end - begin
    index = torch.arange(count)
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping[begin:end],
        block_tables=metadata.block_tables[begin:end],
        query_start_loc=list(range(count + 1)),
        seq_lens=metadata.seq_lens[begin:end],
        decode_req_indices=index,
        decode_token_indices=index,
        decode_seq_lens=metadata.decode_seq_lens[begin:end],
        prefill_req_indices=[],
    )


def install_split(delay_s: float) -> dict[str, bool]:
    pool = ThreadPoolExecutor(2, initializer=lambda: torch.set_num_threads(1))
    mode = {"split": False}
    whole = ModelRunner._run_model

    def run_model(self, input_ids, positions, metadata, num_scheduled):
        if not mode["split"] or not (num_scheduled == 1).all():
            return whole(self, input_ids, positions, metadata, num_scheduled)
        count = len(num_scheduled)

        def forward(begin: int, end: int, delay: float) -> torch.Tensor:
            if delay:
                time.sleep(delay)
            with torch.inference_mode():
                meta = half_metadata(metadata, begin, end)
                return self.model(input_ids[begin:end], positions[begin:end], meta)

        first = pool.submit(forward, 0, count // 2, 0.0)
        second = pool.submit(forward, count // 2, count, delay_s)
        return torch.cat([first.result(), second.result()])

    ModelRunner._run_model = run_model
    return mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--populate-kv-cache", action="store_true")
    args = parser.parse_args()
    mode = install_split(args.delay_ms / 1000)
    llm = LLM(max_num_seqs=args.batch, max_num_batched_tokens=2048, disable_log_stats=True)
    if args.populate_kv_cache:
        step_breakdown.populate_kv_cache(llm)
    engine = llm.llm_engine
    config = DatasetConfig(
        name="random", num_prompts=args.batch, input_len=args.input_len, output_len=10**6
    )
    requests = random_dataset(config, engine.model_config.vocab_size, llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 64, ignore_eos=True)
    for i, request in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": request.prompt_token_ids}, params)
    scheduler = engine.engine_core.scheduler
    while not (
        len(scheduler.running) == args.batch
        and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
    ):
        engine.step()
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.steps):
        mode["split"] = bool(step % 2)
        started = time.perf_counter()
        engine.step()
        times[mode["split"]].append(time.perf_counter() - started)
    for split, values in times.items():
        label = "split" if split else "whole"
        print(
            f"{label} median {1e3 * statistics.median(values):.1f} ms",
            [round(1e3 * v) for v in values],
        )


if __name__ == "__main__":
    main()
