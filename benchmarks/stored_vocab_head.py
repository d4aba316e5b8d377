"""A quantized checkpoint's LM head held in its stored 16-bit dtype
(`model/layers/stored_vocab.py`) against the fp32 head it replaced, on a Llama shape's
vocabulary: ms per call for a few rows (decode), and whether the logits are bit-equal.

The fp32 head is the `Linear` a quantized model had (its oneDNN packed copy left out: below
`fused.PACKED_MIN_ROWS` rows it is not used); the 16-bit head runs the same skinny kernel,
converting each weight vector to fp32 in registers. Random weights: the time does not depend on
the values.

    .venv/bin/python -m benchmarks.stored_vocab_head [--shape llama-3.2-1b] [--rows 1,2]
        [--repeats 20] [--threads 1]

Prints one JSON line per row count; record `lscpu` flags and `uptime`.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.random_gguf import SHAPES
from benchmarks.timing import median_seconds
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.stored_vocab import StoredDtypeHead
from pagedllm.ops.kernel_selection import select_kernels


def heads(vocab: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The 16-bit head and the fp32 head on the same (`dtype`-representable) values."""
    kernels = select_kernels("cpu", torch.float32, "cpu", head_dim=64, cache_dtype=torch.float32)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden).to(dtype), requires_grad=False)
    fp32 = Linear(hidden, vocab, False, torch.float32, kernels)
    fp32.weight.data.copy_(weight)
    return {"fp32": fp32, str(dtype).removeprefix("torch."): StoredDtypeHead(weight, None, kernels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    for dtype in (torch.float16, torch.bfloat16):
        made = heads(shape.vocab_size, shape.hidden_size, dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, shape.hidden_size)
            result = {"shape": args.shape, "rows": rows, "threads": args.threads}
            with torch.inference_mode():
                for name, head in made.items():
                    seconds = median_seconds(lambda head=head, x=x: head(x), args.repeats)
                    result[f"{name}_ms"] = round(seconds * 1e3, 2)
                logits = [head(x) for head in made.values()]
            result["bit_equal"] = torch.equal(*logits)
            print(json.dumps(result), flush=True)
            del logits


if __name__ == "__main__":
    main()
