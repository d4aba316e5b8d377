"""The compiled decode step against the eager forward, in one process, interleaved.

Captures one real decode step of the default model (fp32; `--gguf FILE`: that GGUF file
with `quantization="gguf"`, e.g. Gemma 3 270M's Q4_K_M) at each `--batch` size, then
times the model's forward on it eagerly and through `CompiledDecode`, alternating in
`--rounds` rounds of `--calls` forwards each so that the machine's drift hits both alike.
Prints the median and best of the rounds' medians (ms a forward) and the compile time.

    .venv/bin/python -m benchmarks.compiled_decode [--batch 1,2,3] [--rounds 15] [--calls 10]
        [--gguf FILE]

Only batches the engine would compile are timed (`compiled_batch_limit`: 3 where the linear
layers hold oneDNN-packed weights, which serve larger batches eagerly; 96 without them,
e.g. with PAGEDLLM_ONEDNN=0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.runner.compiled_forward import CompiledDecode, compiled_batch_limit
from pagedllm.runner.model_runner import ForwardStep


def capture_decode(llm: LLM, batch: int) -> tuple:
    """(input_ids, positions, metadata) of a decode step of `batch` requests."""
    steps: list[ForwardStep] = []
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with llm.model_runner.forward_observer(steps.append):
        llm.generate(["Tell me about the sea, please."] * batch, params, use_tqdm=False)
    return steps[-1].model_inputs


def median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,2,3")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--gguf", help="a GGUF file to run with quantization='gguf'")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    model_args = {}
    if args.gguf:  # a short context: Gemma's 32k default would size a large KV pool
        model_args = dict(model=args.gguf, quantization="gguf", max_model_len=1024)
    llm = LLM(dtype="float32", max_num_seqs=max(batches), disable_log_stats=True, **model_args)
    model = llm.model_runner.model
    limit = compiled_batch_limit(model)
    compiled = CompiledDecode(model, limit)
    with torch.inference_mode():
        print(f"compiled in {compiled.warm_up(torch.device('cpu')):.1f} s")
        print("| batch | eager ms (median / best) | compiled ms (median / best) | saved |")
        print("|---|---|---|---|")
        for batch in batches:
            if batch > limit:
                print(f"| {batch} | not compiled by the engine (limit {limit}) | | |")
                continue
            step = capture_decode(llm, batch)
            torch.testing.assert_close(compiled(*step), model(*step), rtol=0, atol=0)
            rounds: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.rounds):
                rounds["eager"].append(median_ms(lambda s=step: model(*s), args.calls))
                rounds["compiled"].append(median_ms(lambda s=step: compiled(*s), args.calls))
            eager, fast = (statistics.median(rounds[k]) for k in ("eager", "compiled"))
            print(
                f"| {batch} | {eager:.2f} / {min(rounds['eager']):.2f} "
                f"| {fast:.2f} / {min(rounds['compiled']):.2f} | {eager - fast:.2f} ms |"
            )


if __name__ == "__main__":
    main()
