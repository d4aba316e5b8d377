"""The checkpoints `benchmarks.quantized_real_size` measures, one per format name: where each
is written (once, outside the repository), the tensor bytes it stores, and the weight bytes
an engine holds after loading it.

The writers stay with their format families (`random_gptq`, `random_w8a8`, `random_gguf`);
the dense row is a config.json alone, loaded with `load_format="dummy"` in the dtype the CPU
multiplies natively (bf16 with AVX512-BF16 or AMX, else fp32). The packed formats may be too
(`write_packed_config`, `--dummy`): random packed layers of the same shapes and bytes, no
checkpoint written; their stored bytes are then computed from one layer's tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.random_gguf import FILE_TYPES, write_random_gguf
from benchmarks.random_gptq import FORMATS as PACKED_FORMATS
from benchmarks.random_gptq import write_random_packed
from benchmarks.random_llama import PROJECTIONS
from benchmarks.random_w8a8 import write_random_w8a8

PACKED = {"gptq-g128": "gptq-4bit-g128", "awq-g128": "awq-4bit-g128", "w4a16-g128": "w4a16-g128"}
EIGHT_BIT = ("w8a8-int8", "fp8-dynamic", "fp8-block")
GGUF = "gguf-q4_k_m"
DENSE = ("bf16", "fp32")
FORMATS = (*PACKED, *EIGHT_BIT, GGUF, *DENSE)
DENSE_BYTES = {"bf16": 2, "fp32": 4}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def dense_format(flags: set[str]) -> str:
    """The dense row's dtype: bf16 where the CPU multiplies it natively, else fp32."""
    return "bf16" if any(flag in flags for flag in BF16_FLAGS) else "fp32"


def checkpoint_path(root: Path, shape_name: str, fmt: str) -> Path:
    """Where `fmt`'s checkpoint of the shape lives under `root` (a file for GGUF, else a
    directory); the packed names keep the directories `random_gptq` has written before."""
    if fmt == GGUF:
        return root / f"random-{shape_name}-q4_k_m.gguf"
    return root / f"random-{shape_name}-{PACKED.get(fmt, fmt)}"


def _write_dense(directory: Path, shape: LlamaShape, fmt: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if fmt == "bf16" else "float32"
    config = {**shape.hf_config(), "torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_checkpoint(path: Path, shape: LlamaShape, fmt: str) -> Path:
    """Writes `fmt`'s random checkpoint of `shape` at `path` unless it is already whole (its
    config.json, or the GGUF file, is written last)."""
    whole = path if fmt == GGUF else path / "config.json"
    if whole.exists():
        return path
    if fmt == GGUF:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_random_gguf(partial, shape, FILE_TYPES["Q4_K_M"])
        partial.rename(path)
    elif fmt in PACKED:
        write_random_packed(path, shape, PACKED[fmt])
    elif fmt in EIGHT_BIT:
        write_random_w8a8(path, shape, fmt)
    else:
        _write_dense(path, shape, fmt)
    return path


def write_packed_config(path: Path, shape: LlamaShape, fmt: str) -> Path:
    """A config.json alone for the packed `fmt` of `shape` (its quantization_config and fp16
    embedding): with `load_format="dummy"` the model its checkpoint would be."""
    from pagedllm.model.loader import write_config_dir

    _, quantization_config = PACKED_FORMATS[PACKED[fmt]]
    config = {**shape.hf_config(), "torch_dtype": "float16"}
    config["quantization_config"] = quantization_config
    return Path(write_config_dir(str(path), config))


def packed_tensor_bytes(shape: LlamaShape, fmt: str) -> dict[str, int]:
    """The tensor bytes `write_random_packed` would store for `fmt` (all of them and the
    projections'), from one decoder layer's tensors: every layer's are the same shapes."""
    layer_tensors, _ = PACKED_FORMATS[PACKED[fmt]]
    generator = torch.Generator().manual_seed(0)
    per_layer = sum(
        tensor.nbytes
        for size in PROJECTIONS.values()
        for tensor in layer_tensors(*size(shape), generator).values()
    )
    projections = shape.num_layers * per_layer
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * 2  # fp16
    heads = 1 if shape.tie_word_embeddings else 2
    embeddings = heads * shape.vocab_size * shape.hidden_size * 2
    return {"all": projections + norms + embeddings, "projections": projections}


def _safetensors_sizes(file: Path) -> dict[str, int]:
    with open(file, "rb") as stream:
        (header_length,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(header_length))
    return {
        name: entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _is_projection(tensor_name: str) -> bool:
    """A decoder layer's projection tensor, in safetensors' names or GGUF's (`blk.N.attn_q`,
    `blk.N.ffn_down`; the norms are not projections)."""
    if tensor_name.startswith("blk."):
        return "norm" not in tensor_name
    return "_proj." in tensor_name


def dense_parameters(shape: LlamaShape) -> int:
    """The parameters a dense checkpoint of `shape` stores (the head once when tied)."""
    sizes = [size(shape) for size in PROJECTIONS.values()]
    per_layer = sum(inputs * outputs for inputs, outputs in sizes) + 2 * shape.hidden_size
    heads = 1 if shape.tie_word_embeddings else 2
    embeddings = heads * shape.vocab_size * shape.hidden_size
    return embeddings + shape.num_layers * per_layer + shape.hidden_size


def checkpoint_tensor_bytes(path: Path, shape: LlamaShape, fmt: str) -> dict[str, int]:
    """The bytes of the tensors the checkpoint stores (metadata and padding left out), all of
    them and the layers' projections; the dense row's are what its safetensors would store."""
    if fmt in DENSE:
        sizes = [size(shape) for size in PROJECTIONS.values()]
        projections = shape.num_layers * sum(inputs * outputs for inputs, outputs in sizes)
        width = DENSE_BYTES[fmt]
        return {"all": dense_parameters(shape) * width, "projections": projections * width}
    if fmt == GGUF:
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    else:
        sizes = {}
        for file in sorted(path.glob("*.safetensors")):
            sizes.update(_safetensors_sizes(file))
    projections = sum(size for name, size in sizes.items() if _is_projection(name))
    return {"all": sum(sizes.values()), "projections": projections}


def _counts_itself(module: torch.nn.Module) -> bool:
    """A quantized layer that is not a container of others (a fused projection of parts)."""
    return hasattr(module, "weight_bytes") and not any(
        hasattr(c, "weight_bytes") for c in module.modules() if c is not module
    )


def held_weight_bytes(model: torch.nn.Module) -> int:
    """The quantized layers' `weight_bytes` (their kernels' packed copies included) plus every
    other parameter and buffer, each storage once."""
    layers = [m for m in model.modules() if _counts_itself(m)]
    inside = {id(t) for layer in layers for t in [*layer.buffers(), *layer.parameters()]}
    others = {
        t.data_ptr(): t
        for t in [*model.buffers(), *model.parameters()]
        if t is not None and id(t) not in inside
    }
    return sum(layer.weight_bytes() for layer in layers) + sum(t.nbytes for t in others.values())


def held_projection_bytes(model: torch.nn.Module) -> int:
    """The bytes the decoder layers' projections hold: a quantized layer's `weight_bytes`, a
    dense one's weight."""
    total = 0
    for name, module in model.named_modules():
        if ".layers." not in f".{name}" or not name.endswith("_proj"):
            continue
        if _counts_itself(module):
            total += module.weight_bytes()
        elif not any(_counts_itself(inner) for inner in module.modules()):
            total += sum(p.nbytes for p in module.parameters(recurse=False) if p.dim() == 2)
    return total
