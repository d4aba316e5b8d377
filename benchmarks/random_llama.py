"""The skeleton every random-weight quantized Llama checkpoint shares: a 16-bit embedding
(and head when the shape does not tie it; the tools never quantize it), the norms, each
decoder layer's projections as the format's tensors, one safetensors file a layer, and
config.json written last so a directory holding it is whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape

PROJECTIONS = {  # name -> (inputs, outputs) as functions of the shape
    "self_attn.q_proj": lambda s: (s.hidden_size, s.num_heads * s.head_dim),
    "self_attn.k_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.v_proj": lambda s: (s.hidden_size, s.num_kv_heads * s.head_dim),
    "self_attn.o_proj": lambda s: (s.num_heads * s.head_dim, s.hidden_size),
    "mlp.gate_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.up_proj": lambda s: (s.hidden_size, s.intermediate_size),
    "mlp.down_proj": lambda s: (s.intermediate_size, s.hidden_size),
}
# (inputs, outputs, generator) -> one projection's tensors by leaf name
LayerTensors = Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _unquantized(shape: LlamaShape, dtype: torch.dtype, generator: torch.Generator) -> dict:
    hidden = shape.hidden_size
    embedding = torch.randn(shape.vocab_size, hidden, generator=generator) * 0.02
    rest = {
        "model.embed_tokens.weight": embedding.to(dtype),
        "model.norm.weight": torch.ones(hidden, dtype=dtype),
    }
    if not shape.tie_word_embeddings:
        head = torch.randn(shape.vocab_size, hidden, generator=generator) * 0.02
        rest["lm_head.weight"] = head.to(dtype)
    return rest


def write_random_llama(
    directory: Path,
    shape: LlamaShape,
    layer_tensors: LayerTensors,
    dtype: torch.dtype,
    quantization_config: dict,
    seed: int = 0,
) -> Path:
    """A checkpoint of `shape` whose projections are `layer_tensors`' and the rest `dtype`."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_unquantized(shape, dtype, generator), directory / "model-rest.safetensors")
    for layer in range(shape.num_layers):
        tensors = {
            f"model.layers.{layer}.{norm}.weight": torch.ones(shape.hidden_size, dtype=dtype)
            for norm in ("input_layernorm", "post_attention_layernorm")
        }
        for name, size in PROJECTIONS.items():
            for leaf, tensor in layer_tensors(*size(shape), generator).items():
                tensors[f"model.layers.{layer}.{name}.{leaf}"] = tensor
        save_file(tensors, directory / f"model-layer-{layer:03d}.safetensors")
    config = {
        **shape.hf_config(),
        "torch_dtype": DTYPE_NAMES[dtype],
        "quantization_config": quantization_config,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
