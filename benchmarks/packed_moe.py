"""What serving a mixture's packed experts packed buys: expert bytes and decode speed.

A Qwen3-MoE-shaped config.json served with `load_format="dummy"` (random weights: decode
speed does not depend on their values) twice: with a GPTQ 4-bit group-128 symmetric
`quantization_config` (every matrix packed, the experts `PackedGroupedExperts`) and without
it, in fp32 (what a GPTQ / AWQ / W4A16 MoE checkpoint had to be dequantized into before its
experts were served packed). For each: the bytes the experts hold, and single-stream decode
tokens/s (`--tokens` greedy tokens after an 8-token prompt, median of `--rounds`, the two
engines interleaved).

    .venv/bin/python -m benchmarks.packed_moe [--hidden 1024] [--experts 8] [--top-k 2]
        [--expert-size 768] [--layers 4] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.moe_decode import add_shape_flags, dummy_engine, interleaved_rounds, print_table
from pagedllm import LLM
from pagedllm.model.layers.packed_experts import PackedGroupedExperts
from pagedllm.model.loader import write_config_dir

VOCAB, HEAD_DIM = 8192, 64
GPTQ_G128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq"}  # fmt: skip


def config(args: argparse.Namespace, packed: bool) -> dict:
    heads = args.hidden // HEAD_DIM
    settings = dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=VOCAB,
        hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=heads // 4, head_dim=HEAD_DIM,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        moe_intermediate_size=args.expert_size, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu",
        rms_norm_eps=1e-6,
    )  # fmt: skip
    if packed:
        settings["quantization_config"] = GPTQ_G128
    return settings


def engine(directory: str, args: argparse.Namespace, packed: bool) -> LLM:
    path = write_config_dir(f"{directory}/{'packed' if packed else 'fp32'}", config(args, packed))
    return dummy_engine(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        engines = {
            "fp32 (dequantized)": engine(directory, args, packed=False),
            "packed (GPTQ g128)": engine(directory, args, packed=True),
        }
        rounds = interleaved_rounds(engines, args)
    print(args)
    print_table(engines, rounds, PackedGroupedExperts)


if __name__ == "__main__":
    main()
