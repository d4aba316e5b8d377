"""GGUF-quantized linear layers (`quantization="gguf"`): weights stay in the file's blocks.

Owns reading a tensor's raw GGUF blocks as integers and scales — Q4_0 / Q4_1 / Q5_0 / Q8_0
as (q, d, m) with w = d*q + m per 32; Q4_K / Q5_K / Q6_K as q with an int8 scale and min per
sub-block under a float per super-block of 256 — packing them into the tile layout of
`torch.ops.pagedllm.gguf_linear` / `gguf_linear_k` (`ops/csrc/gguf_linear.cpp`), and
`GGUFLinear` / `GGUFMergedLinear`. The weights are used exactly as the file stores them (the
fp32 engine dequantizes the same blocks), so the only approximation is the input: each
32-wide block of an activation row becomes two int8 digits with its own scale (~15 bits).
That keeps greedy output on fp32's tokens where one digit does not
(benchmarks/int8_accuracy.py), at the price of two integer dot products per block.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.model.layers.linear import MatmulIntoLinear, SplitOutputs
from pagedllm.ops.cpu_features import gguf_kernel_isa
from pagedllm.ops.extension import load
from pagedllm.utils import round_up

BLOCK = 32
SUPER_BLOCK = 256
TILE_COLS = 8
_T = GGMLQuantizationType


@dataclass(frozen=True)
class KernelType:
    """How the kernel holds one GGUF type."""

    block_bytes: int  # the file's bytes per block
    block_weights: int  # weights per block in the file: 32, or 256 for K-quants
    bits: int  # bits of q the kernel keeps per weight
    kquant: bool  # integer scales per sub-block under a float per super-block
    sub_block: int = BLOCK  # weights per scale


KERNEL_TYPES: dict[GGMLQuantizationType, KernelType] = {
    _T.Q4_0: KernelType(18, 32, 4, False),
    _T.Q4_1: KernelType(20, 32, 4, False),
    _T.Q5_0: KernelType(22, 32, 5, False),
    _T.Q8_0: KernelType(34, 32, 8, False),
    _T.Q4_K: KernelType(144, 256, 4, True),
    _T.Q5_K: KernelType(176, 256, 5, True),
    _T.Q6_K: KernelType(210, 256, 6, True, sub_block=16),
}
# Bytes of one block of 32 weights for a tile's 8 columns, by bits kept per weight.
TILE_BLOCK_BYTES = {4: 128, 5: 160, 6: 192, 8: 256}
# Types whose min is a power of two times d (Q4_0: -8 d; Q5_0: -16 d; Q8_0, kept as q + 128:
# -128 d): the kernel derives m and the layer keeps no min table, 1 bit a weight less.
SYMMETRIC = frozenset({_T.Q4_0, _T.Q5_0, _T.Q8_0})
_NO_MINS = torch.empty(0)
# Two int8 digits per activation; 1 is one digit (faster, and far from fp32's tokens).
DEFAULT_DIGITS = 2


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, :, offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit block: byte j holds element j (low nibble) and element j + 16 (high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def repack_q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """A raw Q5_0 tensor [N, row bytes] as the Q8_0 blocks of the same weights, bit for bit:
    each block keeps its d, and its q - 16 (-16..15) becomes Q8_0's int8 q."""
    blocks = _blocks(raw, _T.Q5_0)
    q = _q5_0_values(blocks).astype(np.int16) - 16
    out = np.empty((*blocks.shape[:2], KERNEL_TYPES[_T.Q8_0].block_bytes), np.uint8)
    out[:, :, :2] = blocks[:, :, :2]
    out[:, :, 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(len(raw), -1)


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """Q5_0's q (0..31) of [N, blocks, 22] blocks: Q4_0's nibbles after 4 bytes of fifth
    bits (bit j: element j)."""
    high_bits = blocks[:, :, 2:6].copy().view("<u4")  # [N, blocks, 1]
    fifth = (high_bits >> np.arange(BLOCK, dtype=np.uint32)) & 1
    return _nibbles(blocks[:, :, 6:]) | (fifth << 4).astype(np.uint8)


def kernel_type_of_run(types: Iterable[GGMLQuantizationType]) -> GGMLQuantizationType | None:
    """The one kernel type a fused projection's consecutive parts of `types` can share: their
    type when they agree, Q8_0 for Q5_0 beside Q8_0 (Gemma 3's q/k and v: Q5_0's q - 16 fits
    Q8_0's int8 q under the same d, one call instead of two), else None."""
    distinct = set(types)
    if len(distinct) == 1:
        return distinct.pop()
    return _T.Q8_0 if distinct == {_T.Q5_0, _T.Q8_0} else None


def as_kernel_type(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, target: GGMLQuantizationType
) -> np.ndarray:
    """Raw blocks of `ggml_type` as `target`'s (kernel_type_of_run's choice): as they are,
    or Q5_0 repacked as Q8_0."""
    if ggml_type == target:
        return raw
    if (ggml_type, target) == (_T.Q5_0, _T.Q8_0):
        return repack_q5_0_as_q8_0(raw)
    raise ValueError(f"{ggml_type.name} blocks cannot be held as {target.name}")


Run = tuple[GGMLQuantizationType, list[np.ndarray]]  # a kernel type and its raw row blocks


def kernel_runs(shards: list[Run]) -> list[Run]:
    """(type, raw rows) of a fused projection's consecutive shards, in runs that share one
    kernel call (`kernel_type_of_run`), each run's rows in its type's blocks."""
    grouped: list[tuple[GGMLQuantizationType, list[Run]]] = []
    for ggml_type, rows in shards:
        joined = kernel_type_of_run([grouped[-1][0], ggml_type]) if grouped else None
        if joined is not None:
            grouped[-1] = (joined, [*grouped[-1][1], (ggml_type, rows)])
        else:
            grouped.append((ggml_type, [(ggml_type, rows)]))
    return [
        (run, [as_kernel_type(raw, part, run) for part, rows in parts for raw in rows])
        for run, parts in grouped
    ]


def _blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """A raw [N, row bytes] tensor as [N, blocks, block bytes]."""
    if ggml_type not in KERNEL_TYPES:
        raise ValueError(f"GGUF type {ggml_type.name} has no quantized kernel")
    block_bytes = KERNEL_TYPES[ggml_type].block_bytes
    rows, row_bytes = raw.shape
    if row_bytes % block_bytes:
        raise ValueError(f"a {ggml_type.name} row of {row_bytes} bytes is not whole blocks")
    return raw.reshape(rows, row_bytes // block_bytes, block_bytes)


def unpack_blocks(
    raw: np.ndarray, ggml_type: GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32]) of a raw [N, row bytes]
    Q4_0 / Q4_1 / Q5_0 / Q8_0 tensor, with every weight equal to d*q + m of its block."""
    blocks = _blocks(raw, ggml_type)
    if KERNEL_TYPES[ggml_type].kquant:
        raise ValueError(f"{ggml_type.name} has scales per super-block: use unpack_k_blocks")
    d = _fp16(blocks, 0)
    if ggml_type == _T.Q8_0:
        # Stored signed; the kernel multiplies unsigned weights, so q + 128 and m = -128 d.
        q = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = -128.0 * d
    elif ggml_type == _T.Q4_1:
        q, m = _nibbles(blocks[:, :, 4:]), _fp16(blocks, 2)
    elif ggml_type == _T.Q5_0:
        q, m = _q5_0_values(blocks), -16.0 * d
    else:  # Q4_0: w = d * (q - 8)
        q, m = _nibbles(blocks[:, :, 2:]), -8.0 * d
    return q.reshape(blocks.shape[0], -1), d, m.astype(np.float32)


@dataclass(frozen=True)
class KBlocks:
    """A K-quant tensor as integers: weight [n, i] = super_d * sc * q + super_m * mn, with
    super_d / super_m of its super-block of 256 and sc / mn of its sub-block."""

    q: np.ndarray  # uint8 [N, K], below 2^bits
    super_d: np.ndarray  # float32 [N, K/256]
    super_m: np.ndarray  # float32 [N, K/256]
    sub_sc: np.ndarray  # int8 [N, K/sub_block]
    sub_mn: np.ndarray  # int8 [N, K/sub_block]; Q6_K: the same array as sub_sc


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins (llama.cpp's get_scale_min_k4)."""
    low, high = packed[..., :4], packed[..., 8:]
    sc = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mid = packed[..., 4:8]
    mn = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.int8), mn.astype(np.int8)


def _q4k_values(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: chunk c of 32 bytes holds sub-block 2c (low nibbles) and
    2c + 1 (high nibbles)."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q6k_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's 128 low and 64 high bytes -> 256 values in 0..63: per half of 128, four runs
    of 32 from the low nibbles of ql[0:32], ql[32:64], then their high nibbles, each with
    2 high bits from qh at shifts 0, 2, 4, 6."""
    lead = ql.shape[:-1]
    low = ql.reshape(*lead, 2, 2, 32)  # half, which 32 of the 64 bytes, l
    nibbles = np.stack([low & 0x0F, low >> 4], axis=-3)  # half, nibble, byte run, l
    nibbles = nibbles.reshape(*lead, 2, 4, 32)
    high = qh.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    return (nibbles | ((high & 3) << 4)).reshape(*lead, 256)


def unpack_k_blocks(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> KBlocks:
    """The integers and scales of a raw [N, row bytes] Q4_K / Q5_K / Q6_K tensor."""
    blocks = _blocks(raw, ggml_type)
    rows = blocks.shape[0]
    if ggml_type == _T.Q6_K:
        d = _fp16(blocks, 208)
        q = _q6k_values(blocks[:, :, :128], blocks[:, :, 128:192])
        sc = blocks[:, :, 192:208].copy().view(np.int8).reshape(rows, -1)
        return KBlocks(q.reshape(rows, -1), d, -32.0 * d, sc, sc)
    if ggml_type not in (_T.Q4_K, _T.Q5_K):
        raise ValueError(f"{ggml_type.name} is not a K-quant: use unpack_blocks")
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, mn = _k_scales(blocks[:, :, 4:16])
    if ggml_type == _T.Q4_K:
        q = _q4k_values(blocks[:, :, 16:144])
    else:  # Q5_K: sub-block j's high bits are bit j of qh[l]
        qh = blocks[:, :, 16:48].reshape(rows, -1, 1, 32)
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        q = _q4k_values(blocks[:, :, 48:176]) | (high.reshape(rows, -1, 256) << 4)
    return KBlocks(q.reshape(rows, -1), d, -dmin, sc.reshape(rows, -1), mn.reshape(rows, -1))


def _pad_rows(values: torch.Tensor, padded: int) -> torch.Tensor:
    """Zero rows up to `padded` (zero columns of the output, never written out)."""
    if values.shape[0] == padded:
        return values
    return torch.cat([values, values.new_zeros(padded - values.shape[0], *values.shape[1:])])


def pack_q(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's layout of q [N, K]: columns in tiles of 8; per tile and block, groups of
    4 consecutive k for the tile's 8 columns. 4-, 5- and 6-bit: two groups' low nibbles a
    byte (g and g + 4), then 32 bytes of bit g of group g's (5-bit) or two planes of 2 bits
    (6-bit: plane v, bits 2s..2s+1 of group 4v + s); 8-bit: one byte a weight."""
    q = _pad_rows(q, round_up(q.shape[0], TILE_COLS))
    tiles, blocks = q.shape[0] // TILE_COLS, q.shape[1] // BLOCK
    # [tile, col, block, group, 4] -> [tile, block, group, col * 4]
    grouped = q.reshape(tiles, TILE_COLS, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(tiles, blocks, 8, 32)
    if bits == 8:
        return grouped.contiguous().reshape(-1)
    low = grouped & 0x0F
    planes = [low[:, :, :4] | (low[:, :, 4:] << 4)]
    high = grouped >> 4
    if bits == 5:
        plane = torch.zeros_like(high[:, :, 0])
        for g in range(8):
            plane |= (high[:, :, g] & 1) << g
        planes.append(plane[:, :, None])
    elif bits == 6:
        for v in range(2):
            plane = torch.zeros_like(high[:, :, 0])
            for s in range(4):
                plane |= (high[:, :, 4 * v + s] & 3) << (2 * s)
            planes.append(plane[:, :, None])
    return torch.cat(planes, dim=2).contiguous().reshape(-1)


def per_tile(values: torch.Tensor) -> torch.Tensor:
    """[N, n] per-row values -> [tiles, n, 8]: each tile's 8 columns side by side."""
    values = _pad_rows(values, round_up(values.shape[0], TILE_COLS))
    tiles = values.shape[0] // TILE_COLS
    return values.reshape(tiles, TILE_COLS, -1).permute(0, 2, 1).contiguous()


def pack_weights(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q5_0 / Q8_0 in the kernel's layout: (packed q, d and m per tile)."""
    return pack_q(q, bits), per_tile(d.float()), per_tile(m.float())


def reference_pack_gguf(
    raw: np.ndarray, ggml_type: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """`pack_gguf` in numpy and torch, step by step: the reference the C++ pass is tested
    against (and ~20x slower: ~15 passes over the weights)."""
    kind = KERNEL_TYPES.get(ggml_type)
    if kind is not None and kind.kquant:
        k = unpack_k_blocks(raw, ggml_type)
        tables = {
            "super_d": per_tile(torch.from_numpy(k.super_d)),
            "super_m": per_tile(torch.from_numpy(k.super_m.astype(np.float32))),
            "sub_sc": per_tile(torch.from_numpy(k.sub_sc)),
        }
        tables["sub_mn"] = (
            tables["sub_sc"] if k.sub_mn is k.sub_sc else per_tile(torch.from_numpy(k.sub_mn))
        )
        return {"packed": pack_q(torch.from_numpy(k.q), kind.bits), **tables}
    q, d, m = unpack_blocks(raw, ggml_type)
    packed, scales, mins = pack_weights(
        torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), KERNEL_TYPES[ggml_type].bits
    )
    if ggml_type in SYMMETRIC:
        mins = _NO_MINS
    return {"packed": packed, "scales": _held_scales(scales), "mins": mins}


def _held_scales(scales: torch.Tensor) -> torch.Tensor:
    """The d table as the layer holds it: the file's fp16 (every value came from one, so
    exactly), half a bit a weight fewer to read than fp32 (Q8_0 at the file's 8.5 bits
    instead of 9: a 262k-row tied head is 6% fewer bytes a token)."""
    return scales.half()


def pack_gguf(
    raw: np.ndarray | list[np.ndarray], ggml_type: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """The tensors the kernel reads for a raw GGUF weight [N, row bytes] (or the parts of a
    fused one, stacked), by buffer name, built in one C++ pass (`ops/csrc/gguf_pack.cpp`).
    Q6_K's min table is its scale table (m = -32 d sc): one tensor under both names. Q4_0's
    and Q8_0's "mins" is empty: the kernel derives m from d."""
    parts = raw if isinstance(raw, list) else [raw]
    if any(len(part) % TILE_COLS for part in parts[:-1]):  # a tile would straddle two parts
        parts = [np.concatenate(parts)]
    kind = KERNEL_TYPES.get(ggml_type)
    blocks = [_blocks(part, ggml_type) for part in parts]  # checks the type and row length
    rows, k = sum(len(b) for b in blocks), blocks[0].shape[1] * kind.block_weights
    tiles, k_blocks = -(-rows // TILE_COLS), k // BLOCK
    # Uninitialized: the pass writes every byte (zeroing 5 GB would cost seconds).
    # One flat tensor (the buffer the layer keeps: a view would keep its base alive when the
    # weights move onto huge pages), sliced by tiles through a 2-D view.
    packed = torch.empty(tiles * k_blocks * TILE_BLOCK_BYTES[kind.bits], dtype=torch.uint8)
    packed_tiles = packed.view(tiles, -1)
    if kind.kquant:
        scales = {
            n: torch.empty(tiles, k // SUPER_BLOCK, TILE_COLS) for n in ("super_d", "super_m")
        }
        subs = k_blocks * BLOCK // kind.sub_block
        scales["sub_sc"] = torch.empty(tiles, subs, TILE_COLS, dtype=torch.int8)
        own_mins = ggml_type != _T.Q6_K
        scales["sub_mn"] = torch.empty_like(scales["sub_sc"]) if own_mins else scales["sub_sc"]
    else:
        scales = {n: torch.empty(tiles, k_blocks, TILE_COLS) for n in ("scales", "mins")}
        if ggml_type in SYMMETRIC:
            scales["mins"] = _NO_MINS
    first_tile = 0
    for part in parts:  # each part into its own tiles of the tables: no stacked copy
        part_tiles = slice(first_tile, first_tile + -(-len(part) // TILE_COLS))
        views = [t[part_tiles] if t.numel() else t for t in scales.values()]
        if not kind.kquant:
            views += [torch.empty(0, dtype=torch.int8)] * 2
        elif not own_mins:
            views[-1] = torch.empty(0, dtype=torch.int8)  # the kernel fills sc alone
        with warnings.catch_warnings():  # the file's read-only mapping: the pass only reads
            warnings.simplefilter("ignore", UserWarning)
            raw_tensor = torch.from_numpy(part.reshape(len(part), -1))
        load().gguf_pack(raw_tensor, ggml_type.value, packed_tiles[part_tiles], *views)
        first_tile = part_tiles.stop
    if not kind.kquant:
        scales["scales"] = _held_scales(scales["scales"])
    return {"packed": packed, **scales}


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`, each storage counted once (tables shared between layers, or one
    table under two names)."""
    unique = {t.data_ptr(): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _keep_bias(module: nn.Module, bias: torch.Tensor | None) -> None:
    """The model's own bias parameter (with its loader: a layer swapped in before loading
    gets its bias from the checkpoint like the fp32 layer), or a plain tensor as fp32."""
    if isinstance(bias, nn.Parameter):
        module.bias = bias
    else:
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        module.register_buffer("bias", bias)


class GGUFLinear(MatmulIntoLinear):
    """y = x W^T (+ b) with W in GGUF blocks, computed by the gguf_linear kernel."""

    def __init__(
        self,
        raw: np.ndarray | list[np.ndarray],
        ggml_type: GGMLQuantizationType,
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__()
        for name, tensor in pack_gguf(raw, ggml_type).items():  # refuses types without kernel
            self.register_buffer(name, tensor)
        kind = KERNEL_TYPES[ggml_type]
        parts = raw if isinstance(raw, list) else [raw]
        self.out_features = sum(len(part) for part in parts)
        self.in_features = parts[0].shape[1] // kind.block_bytes * kind.block_weights
        self.ggml_type = ggml_type
        self.bits = kind.bits
        self.kquant = kind.kquant
        self.digits = digits
        # The widest kernel path allowed (0 portable, 1 AVX2, 2 AVX-512 VNNI); the kernel
        # lowers it to what the CPU has. Tests lower it to check the other paths' bits.
        self.isa = gguf_kernel_isa()
        self._ops = load()
        _keep_bias(self, bias)

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        """out [rows, out_features] (rows may be strided) = x2 [rows, in_features] W^T."""
        if self.kquant:
            self._ops.gguf_linear_k(
                out, x2, self.packed, self.super_d, self.super_m, self.sub_sc, self.sub_mn,
                self.bits, self.digits, self.isa,
            )  # fmt: skip
        else:
            self._ops.gguf_linear(
                out, x2, self.packed, self.scales, self.mins, self.bits, self.digits, self.isa
            )

    def weight_bytes(self) -> int:
        """Bytes of the kernel's tables (a table shared by two names counted once)."""
        return distinct_bytes(t for n, t in self.named_buffers() if n != "bias")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"type={self.ggml_type.name}, digits={self.digits}"
        )


class GGUFMergedLinear(SplitOutputs, GGUFLinear):
    """Fused q/k/v or gate/up in GGUF blocks; splits its output like the fp32 layer."""

    def __init__(
        self,
        raw: np.ndarray | list[np.ndarray],
        ggml_type: GGMLQuantizationType,
        output_sizes: list[int],
        bias: torch.Tensor | None = None,
        digits: int = DEFAULT_DIGITS,
    ) -> None:
        super().__init__(raw, ggml_type, bias, digits)
        self.output_sizes = list(output_sizes)


class GGUFConcatLinear(SplitOutputs, nn.Module):
    """A fused projection whose parts have different GGUF types: one kernel layer per run of
    equal types, each writing its own columns of one output (then split like the fp32
    layer's)."""

    def __init__(
        self,
        parts: list[GGUFLinear],
        output_sizes: list[int],
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.output_sizes = list(output_sizes)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        _keep_bias(self, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        first = 0
        for part in self.parts:
            part.matmul_into(x2, out[:, first : first + part.out_features])
            first += part.out_features
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*leading, self.out_features)

    def weight_bytes(self) -> int:
        return sum(part.weight_bytes() for part in self.parts)
