"""What keeping a mixture's experts on their GGUF blocks buys: decode speed and expert bytes.

Writes a random-weight Qwen3-MoE-shaped GGUF file (`--qtype` matrices and experts, the
router and norms F32, as llama.cpp's quantizer leaves them) and serves it with
`quantization="gguf"` twice: experts dequantized to fp32 (the behaviour before
`GGUFGroupedExperts`; every other matrix on its blocks in both) and experts on their blocks.
For each: the bytes the experts hold, and single-stream decode tokens/s (`--tokens` greedy
tokens after an 8-token prompt, median of `--rounds`, the two engines interleaved).

    .venv/bin/python -m benchmarks.gguf_moe [--hidden 1024] [--experts 8] [--top-k 2]
        [--expert-size 768] [--layers 4] [--qtype Q8_0] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.gguf_files import add_model_shape, add_tensor, finish
from benchmarks.moe_decode import add_shape_flags, interleaved_rounds, print_table
from pagedllm import LLM
from pagedllm.model.gguf.tensor_names import gguf_tensor_names
from pagedllm.model.layers.gguf_experts import GGUFGroupedExperts

VOCAB, HEAD_DIM, ARCH = 8192, 64, "qwen3moe"


def write_file(path: Path, args: argparse.Namespace) -> None:
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // HEAD_DIM,
        num_key_value_heads=args.hidden // HEAD_DIM // 4, head_dim=HEAD_DIM,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        moe_intermediate_size=args.expert_size, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), ARCH)
    add_model_shape(writer, config, "moe-bench")
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<{i}>" for i in range(VOCAB)])
    state = model.state_dict()
    names = gguf_tensor_names(list(state), ARCH, config.num_hidden_layers)
    qtype = Q[args.qtype]
    for hf_name, tensor in state.items():
        array = tensor.float().numpy()
        parts = names[hf_name]  # stacked gate_up: the file's gate and up parts
        split = np.split(array, len(parts), axis=1) if len(parts) > 1 else [array]
        for name, part in zip(parts, split, strict=True):
            kind = Q.F32 if part.ndim < 2 or ".ffn_gate_inp." in name else qtype
            add_tensor(writer, name, part, kind)
    finish(writer)


def engine(path: Path, experts_on_blocks: bool) -> LLM:
    common = dict(quantization="gguf", skip_tokenizer_init=True, max_model_len=512,
                  max_num_seqs=1, kv_cache_memory="64MiB", disable_log_stats=True)  # fmt: skip
    if experts_on_blocks:
        return LLM(str(path), **common)
    with mock.patch("pagedllm.model.layers.gguf_swap._swap_experts", return_value={}):
        return LLM(str(path), **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_flags(parser)
    parser.add_argument("--qtype", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_1"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "moe.gguf"
        write_file(path, args)
        engines = {"experts fp32": engine(path, False), "experts on blocks": engine(path, True)}
        rounds = interleaved_rounds(engines, args)
        print(f"file {path.stat().st_size / 1e6:.1f} MB, {args}")
        print_table(engines, rounds, GGUFGroupedExperts)


if __name__ == "__main__":
    main()
