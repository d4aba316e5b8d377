"""Single-stream decode of a random-weight GPTQ 4-bit checkpoint against the same shape as
GGUF Q4_K_M, both in pagedllm.

The GPTQ checkpoint (group 128, symmetric, no act-order, the head unquantized and tied to an
fp16 embedding, as GPTQ tools write Llama-3.2-1B) holds random packed integers and scales:
decode speed does not depend on the values. It is written once under pagedllm's cache root;
the Q4_K_M file is `benchmarks.real_size`'s (written into the peers' cache on first use).
Each engine runs in a child process of its own: load, the weight buffers' bytes, then
tokens/s of a 64-token greedy decode from a 1-token prompt.

    .venv/bin/python -m benchmarks.random_gptq [--shape llama-3.2-1b] [--decode-tokens 64]

Prints one JSON object; record the CPU's flags (`lscpu`) and the load (`uptime`) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.peers.common import PeerPaths
from benchmarks.random_gguf import SHAPES
from benchmarks.real_size import (
    _memory_and_decode,
    _rss_bytes,
    model_file,
    single_stream_decode_rate,
)
from pagedllm.utils import cache_root

GROUP_SIZE = 128
PROJECTIONS = {  # name -> (inputs, outputs) as functions of the shape
    "self_attn.q_proj": lambda s: (s.hidden_size, s.num_heads * s.head_dim),
    "self_attn.k_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.v_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.o_proj": lambda s: (s.num_heads * s.head_dim, s.hidden_size),
    "mlp.gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.down_proj": lambda s: (s.intermediate_size, s.hidden_size),
}


def _gptq_layer(inputs: int, outputs: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    groups = inputs // GROUP_SIZE
    words = torch.randint(-(2**31), 2**31 - 1, (inputs // 8, outputs), generator=generator)
    scales = torch.rand(groups, outputs, generator=generator) * 2e-3 + 1e-3
    return {
        "qweight": words.to(torch.int32),
        "qzeros": torch.full((groups, outputs // 8), 0x77777777, dtype=torch.int32),
        "scales": scales.half(),
        "g_idx": (torch.arange(inputs) // GROUP_SIZE).to(torch.int32),
    }


def write_random_gptq(directory: Path, shape: LlamaShape, seed: int = 0) -> Path:
    """A GPTQ 4-bit g128 checkpoint of `shape` with random packed weights, one file a layer."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    hidden = shape.hidden_size
    rest = {
        "model.embed_tokens.weight": (
            torch.randn(shape.vocab_size, hidden, generator=generator) * 0.02
        ).half(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
    }
    save_file(rest, directory / "model-rest.safetensors")
    for layer in range(shape.num_layers):
        tensors = {
            f"model.layers.{layer}.{norm}.weight": torch.ones(hidden, dtype=torch.float16)
            for norm in ("input_layernorm", "post_attention_layernorm")
        }
        for name, size in PROJECTIONS.items():
            for leaf, tensor in _gptq_layer(*size(shape), generator).items():
                tensors[f"model.layers.{layer}.{name}.{leaf}"] = tensor
        save_file(tensors, directory / f"model-layer-{layer:03d}.safetensors")
    config = {
        **shape.hf_config(),
        "torch_dtype": "float16",
        "quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": GROUP_SIZE, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq",
        },
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def gptq_checkpoint(shape: str) -> Path:
    directory = cache_root() / "models" / f"random-{shape}-gptq-4bit-g128"
    if not (directory / "config.json").exists():
        write_random_gptq(directory, SHAPES[shape])  # config.json last: a whole checkpoint
    return directory


def child(path: str, decode_tokens: int) -> dict:
    import time

    from pagedllm import LLM

    quantization = "gguf" if path.endswith(".gguf") else None
    started = time.perf_counter()
    llm = LLM(
        model=path, quantization=quantization, max_model_len=1024, kv_cache_memory="1GiB",
        skip_tokenizer_init=True,
    )  # fmt: skip
    load_s = time.perf_counter() - started
    rss = _rss_bytes()
    model = llm.model_runner.model
    tensors = [*model.buffers(), *model.parameters()]
    weights = sum(t.nbytes for t in {t.data_ptr(): t for t in tensors}.values())
    return _memory_and_decode(load_s, rss, weights, single_stream_decode_rate(llm, decode_tokens))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.decode_tokens)))
        return
    peers = PeerPaths().root
    results = {"shape": args.shape, "uptime": os.getloadavg()}
    for name, path in (
        ("gptq-4bit-g128", gptq_checkpoint(args.shape)),
        ("gguf-q4_k_m", model_file(args.shape, peers)),
    ):
        command = [sys.executable, "-m", "benchmarks.random_gptq", "--child", str(path)]
        command += ["--decode-tokens", str(args.decode_tokens)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[name] = json.loads(output.strip().splitlines()[-1])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
