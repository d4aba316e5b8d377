"""KV memory a long Gemma 3 conversation holds, with and without sliding-window freeing.

Gemma 3's local layers see only their last `sliding_window` tokens. This steps the engine's
own `KVCacheManager` through requests of `--input-len` prompt tokens (prefilled in chunks of
`--chunk` tokens) and `--output-len` decoded tokens, once with the model's KV cache groups
(windowed groups free the blocks their window has passed) and once with every layer kept
whole, and reports each request's peak blocks, their bytes (the engine's own per-block
size) and how many such requests a `--kv-cache-memory` pool holds at once. The shape is
Gemma 3 270M's (`--model` reads another config: a GGUF path or a model directory).

    .venv/bin/python -m benchmarks.sliding_window_kv [--input-len 4096] [--output-len 512]
        [--block-size 16] [--kv-cache-memory 4GiB] [--model PATH] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagedllm.config import ModelConfig, kv_cache_groups, parse_memory_size
from pagedllm.core.engine_config import kv_bytes_per_block, model_kv_groups
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

# Gemma 3 270M's attention shape (its GGUF's metadata).
GEMMA3_270M = dict(
    num_hidden_layers=18,
    hidden_size=640,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    sliding_window=512,
    max_position_embeddings=32768,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
)


def load_config(model: str | None):
    if model is None:
        from transformers import AutoConfig

        return AutoConfig.for_model(
            "gemma3_text", architectures=["Gemma3ForCausalLM"], **GEMMA3_270M
        )
    from pagedllm.model.loader import load_hf_config, resolve_model

    return load_hf_config(resolve_model(model))


def held_blocks(groups, args: argparse.Namespace) -> tuple[int, int]:
    """(the most blocks one request holds from its first chunk on, those it holds at its
    last token). The peak falls in the prefill: a chunk's blocks are all written before its
    window moves on."""
    manager = KVCacheManager(1 << 20, args.block_size, False, groups.windows)
    request = Request("r", list(range(args.input_len)), SamplingParams(max_tokens=args.output_len))
    peak = 0
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(args.chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        peak = max(peak, manager.num_held_blocks("r"))
    request.output_token_ids.append(0)
    for _ in range(args.output_len - 1):
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.output_token_ids.append(0)
        peak = max(peak, manager.num_held_blocks("r"))
    last = manager.num_held_blocks("r")
    manager.free(request)
    return peak, last


def measure(args: argparse.Namespace) -> dict:
    hf_config = load_config(args.model)
    max_len = args.input_len + args.output_len
    model_config = ModelConfig(
        model="gemma3",
        hf_config=hf_config,
        dtype=torch.float32,
        max_model_len=max_len,
        eos_token_ids=frozenset(),
    )
    memory = parse_memory_size(args.kv_cache_memory)
    results = {}
    for name, groups in (
        ("window freeing", model_kv_groups(hf_config, max_len)),
        ("every layer whole", kv_cache_groups([None] * hf_config.num_hidden_layers)),
    ):
        bytes_per_block = kv_bytes_per_block(
            model_config, args.block_size, torch.float32, None, groups
        )
        peak, last = held_blocks(groups, args)
        num_blocks = memory // bytes_per_block - 1  # less the null block
        results[name] = {
            "kv_cache_groups": groups.num_groups,
            "layers_per_block": groups.layers_per_group,
            "peak_blocks_per_request": peak,
            "peak_kv_bytes_per_request": peak * bytes_per_block,
            "last_token_kv_bytes_per_request": last * bytes_per_block,
            # As the start-up log counts it: requests of max_model_len, decoding.
            "max_concurrency_decoding": num_blocks // last,
            "max_concurrency_all_in_prefill": num_blocks // peak,
        }
    whole, windowed = results["every layer whole"], results["window freeing"]
    return {
        "workload": f"{args.input_len} prompt tokens (chunks of {args.chunk}), "
        f"{args.output_len} output, block size {args.block_size}, fp32 KV",
        "kv_cache_memory": memory,
        "results": results,
        "memory_ratio_at_peak": round(
            whole["peak_kv_bytes_per_request"] / windowed["peak_kv_bytes_per_request"], 2
        ),
        "memory_ratio_at_last_token": round(
            whole["last_token_kv_bytes_per_request"] / windowed["last_token_kv_bytes_per_request"],
            2,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a config to read (default: 270M's shape)")
    parser.add_argument("--input-len", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=512, help="decoded tokens")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default="4GiB", help="the pool's size")
    parser.add_argument("--output-json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    report = measure(args)
    print(json.dumps(report, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
