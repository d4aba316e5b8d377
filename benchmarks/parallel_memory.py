"""Weight and KV-cache memory per rank of a Llama-shaped model at each tensor/pipeline layout.

Computed from the config's shapes with the same rules the model uses to shard: heads and
MLP columns split over `tp` ranks, KV heads split (or replicated when `tp > num_kv_heads`),
the vocabulary padded to divide, layers split over `pp` stages (`pipeline_stage_layers`),
the embedding on the first stage and the LM head on the last. The figure per layout is the
largest rank's. docs/distributed.md holds the tables for Llama-3-8B and -70B shapes.

    .venv/bin/python -m benchmarks.parallel_memory [--dtype-bytes 2]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pagedllm.parallel_config import (
    num_kv_heads_per_rank,
    padded_vocab_size,
    pipeline_stage_layers,
)


@dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self) -> dict:
        """The shape as a Hugging Face `config.json` (with `load_format="dummy"` a model)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }


LLAMA_3_8B = LlamaShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256)
LLAMA_3_70B = LlamaShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256)


def layer_params_per_rank(shape: LlamaShape, tp: int) -> int:
    head_dim, hidden = shape.head_dim, shape.hidden_size
    q_heads = shape.num_heads // tp
    kv_heads = num_kv_heads_per_rank(shape.num_kv_heads, tp)
    qkv = hidden * (q_heads + 2 * kv_heads) * head_dim
    o = q_heads * head_dim * hidden
    mlp = 3 * hidden * (shape.intermediate_size // tp)
    return qkv + o + mlp + 2 * hidden  # two RMSNorm weights, replicated


def weight_params_per_rank(shape: LlamaShape, tp: int, pp: int, pp_rank: int) -> int:
    vocab_shard = padded_vocab_size(shape.vocab_size, tp) // tp * shape.hidden_size
    layers = len(pipeline_stage_layers(shape.num_layers, pp, pp_rank))
    params = layers * layer_params_per_rank(shape, tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        params += vocab_shard
    if last:
        params += shape.hidden_size  # final norm
        if not (shape.tie_word_embeddings and first):
            params += vocab_shard
    return params


def kv_bytes_per_token_per_rank(shape: LlamaShape, tp: int, pp: int, dtype_bytes: int) -> int:
    layers = len(pipeline_stage_layers(shape.num_layers, pp, 0))  # stage 0 is the largest
    return 2 * layers * num_kv_heads_per_rank(shape.num_kv_heads, tp) * shape.head_dim * dtype_bytes


def memory_table(shape: LlamaShape, dtype_bytes: int, sizes=(1, 2, 4, 8)) -> str:
    rows = [
        f"{shape.name} ({dtype_bytes}-byte weights and KV): largest rank's weights (GiB) / KV "
        "cache per token (KiB)",
        "",
        "| tp \\ pp | " + " | ".join(f"pp={pp}" for pp in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for tp in sizes:
        cells = []
        for pp in sizes:
            weights = max(weight_params_per_rank(shape, tp, pp, r) for r in range(pp))
            kv = kv_bytes_per_token_per_rank(shape, tp, pp, dtype_bytes)
            cells.append(f"{weights * dtype_bytes / 1024**3:.2f} / {kv / 1024:.0f}")
        rows.append(f"| tp={tp} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2: bf16, 4: fp32")
    args = parser.parse_args()
    for shape in (LLAMA_3_8B, LLAMA_3_70B):
        print(memory_table(shape, args.dtype_bytes), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
