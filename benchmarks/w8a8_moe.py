"""What serving a mixture's 8-bit experts 8-bit buys: expert bytes and decode speed.

A Qwen3-MoE-shaped config.json (the shape of `benchmarks.packed_moe`) served with
`load_format="dummy"` (random weights: decode speed does not depend on their values) in
fp32 and with each 8-bit `quantization_config` of `benchmarks.random_w8a8` (compressed-tensors
int8 W8A8 per channel with per-token activations, FP8 dynamic per channel, `quant_method`
fp8 in 128 x 128 blocks; every matrix 8-bit, the experts `W8A8GroupedExperts`). For each:
the bytes the experts hold, and single-stream decode tokens/s (`--tokens` greedy tokens
after an 8-token prompt, median of `--rounds`, the engines interleaved).

    .venv/bin/python -m benchmarks.w8a8_moe [--hidden 1024] [--experts 8] [--top-k 2]
        [--expert-size 768] [--layers 4] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.moe_decode import add_shape_flags, dummy_engine, interleaved_rounds, print_table
from benchmarks.packed_moe import config
from benchmarks.random_w8a8 import SCHEMES, quantization_config
from pagedllm import LLM
from pagedllm.model.layers.w8a8_experts import W8A8GroupedExperts
from pagedllm.model.loader import write_config_dir


def engine(directory: str, args: argparse.Namespace, scheme: str | None) -> LLM:
    settings = config(args, packed=False)
    if scheme is not None:
        settings["quantization_config"] = quantization_config(scheme)
    path = write_config_dir(f"{directory}/{scheme or 'fp32'}", settings)
    return dummy_engine(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        engines = {"fp32 (dequantized)": engine(directory, args, None)}
        engines.update({scheme: engine(directory, args, scheme) for scheme in SCHEMES})
        rounds = interleaved_rounds(engines, args)
    print(args)
    print_table(engines, rounds, W8A8GroupedExperts)


if __name__ == "__main__":
    main()
