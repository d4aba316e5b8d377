"""Fused element-wise ops of the decoder step, the sampler's plain draw and the linear
layers' few-row (decode) path.

Each op has a torch reference (any device and dtype) and a C++ kernel (ops/csrc/cpu_ops.cpp)
that makes one pass over memory where the torch sequence makes several and allocates
temporaries. Which of the two runs is the engine's `KernelSelection` (`kernels`, decided once
in `ops/kernel_selection.py`); per call an op checks only that the tensors are laid out as
its kernel takes them (fp32, or bf16 for the element-wise ops; CPU; unit stride), else it
runs the reference. Kernels work in place where the reference returns new tensors: callers
use the return values only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.ops.cpu_features import cpu_features
from pagedllm.ops.extension import load
from pagedllm.ops.kernel_selection import TORCH_KERNELS, KernelSelection


def _kernel_fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


# The element-wise kernels (norms, SiLU·up, RoPE) take bf16 too, rounding where the eager
# bf16 ops round; the linear and sampler kernels take fp32 only.
_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)


def _elementwise_fits(x: torch.Tensor, *alike: torch.Tensor) -> bool:
    # is_cpu, not device.type: these checks run ~200 times a decode step, and a device
    # object is made each time it is read.
    dtype = x.dtype
    return (
        dtype in _ELEMENTWISE_DTYPES
        and x.is_cpu
        and all(t.dtype == dtype and t.is_cpu for t in alike)
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    kernels: KernelSelection = TORCH_KERNELS,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """norm(x) with no residual; with one, (norm(x + residual), x + residual), which the
    kernel computes in place in x and residual (the residual stream of the decoder). The
    scale is `weight_offset + weight` (Gemma stores its weight as an offset from one)."""
    if kernels.fused_ops and _elementwise_fits(x, weight) and x.stride(-1) == 1:
        if residual is None and x.dim() in (2, 3):
            # A 3-D x may be a strided range of heads; the kernel writes them contiguous.
            out = torch.empty(x.shape, dtype=x.dtype)
            load().rms_norm(out, x, weight, eps, weight_offset)
            return out, None
        if (
            residual is not None
            and x.dim() == 2
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.stride(-1) == 1
        ):
            load().fused_add_rms_norm(x, residual, weight, eps, weight_offset)
            return x, residual
    if residual is not None:
        residual = x + residual
        x = residual
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight_offset + weight if weight_offset else weight
    return scale * h.to(input_dtype), residual


# Up to this many rows the skinny kernel (one pass over the weight on every thread) beats
# torch's sgemm, which runs the fewest rows on one thread and blocks for larger problems
# (the two met between 96 and 128 rows): benchmarks/results/matmul.md.
SKINNY_MAX_ROWS = 96


def _packed_min_rows() -> int:
    """From this many rows on, a weight prepacked for oneDNN (`packed`) beats the skinny
    kernel. oneDNN's fp32 kernels use AVX-512 where the CPU has it: there it wins from four
    rows (the default model's projections: 18.7 against 19.4 ms at four, 22.2 against 17.9
    at one); on AVX2 alone it loses up to 16 rows (65.1 against 42.2 ms at five, 94.3
    against 79.2 at 16) and wins from 32 (114.3 against 135.7):
    benchmarks/results/matmul.md."""
    return 4 if cpu_features().avx512f else 24


PACKED_MIN_ROWS = _packed_min_rows()


# From this many rows a bf16 layer with an fp32 packed copy multiplies on it: where bf16
# dot products issue at half the FMA rate (Intel without AMX) the fp32 copy wins from 16
# rows (the default model's and Llama-3.2-1B's projections: 158-223 against 136-174
# GFLOP/s), while up to 8 rows the bf16 copy's half-size reads win (45-58 against 21-26
# GFLOP/s at one row): benchmarks/results/bf16.md.
BF16_IN_FP32_MIN_ROWS = 16


# Up to this many rows a bf16 layer with its weight in AMX tiles multiplies there: one
# pass over the weight without oneDNN's ~20-30 us of host work a call. The default model's
# projections on Sapphire Rapids, 30 layers and the head with the weights read from memory:
# 14.0 against 19.5 ms at one row, 18.1 against 23.9 at 32, 25.2 against 28.1 at 64, but
# 40.5 against 37.7 at 128 (the head's 49,152 columns: every block reads all the rows
# again), though a layer's four projections in cache still took 0.65 against 0.70 ms there
# (benchmarks.amx_linear; benchmarks/results/bf16.md, "AMX").
AMX_MAX_ROWS = 64


# Up to this many rows a bf16 layer whose kernels choose AVX512-BF16 dot products
# (`KernelSelection.bf16_dot_linear`) multiplies on the tile-layout copy in one pass,
# without oneDNN's host work a call.
BF16_DOT_MAX_ROWS = 64


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: KernelSelection = TORCH_KERNELS,
    packed: torch.Tensor | None = None,
    packed_fp32: torch.Tensor | None = None,
    packed_amx: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b), W shaped [out, in]. With `packed_amx` (a bf16 W in AMX tiles' layout,
    `model/layers/amx_tiles.py`) bf16 batches of up to AMX_MAX_ROWS rows run in the AMX
    kernel, or of up to BF16_DOT_MAX_ROWS in the AVX512-BF16 one where the kernels say so.
    With `packed` (W prepacked for oneDNN, `model/layers/onednn.py`) batches of
    PACKED_MIN_ROWS rows or more run on oneDNN (and every bf16 batch the tile-layout kernels
    do not take: the skinny kernel takes fp32 only), and with `packed_fp32` (a bf16 W's fp32
    copy) bf16 batches of BF16_IN_FP32_MIN_ROWS or more multiply in fp32; the fewest rows go
    to the skinny kernel, and the rest to torch's sgemm."""
    # Compiled graphs keep the skinny kernel: the tracer does not take oneDNN's opaque
    # packed tensors (and checked first, the row count adds no guard to the graph).
    if not torch.compiler.is_compiling() and x.dim() == 2:
        rows = x.shape[0]
        if packed_amx is not None and x.dtype == torch.bfloat16:
            tile_kernel, max_rows = (
                (bf16_dot_linear, BF16_DOT_MAX_ROWS)
                if kernels.bf16_dot_linear
                else (amx_linear, AMX_MAX_ROWS)
            )
            if rows <= max_rows:
                return tile_kernel(x, packed_amx, bias)
        if packed_fp32 is not None and rows >= BF16_IN_FP32_MIN_ROWS:
            fp32_bias = None if bias is None else bias.float()
            return onednn_linear(x.float(), packed_fp32, fp32_bias).to(x.dtype)
        if packed is not None and (rows >= PACKED_MIN_ROWS or x.dtype == torch.bfloat16):
            return onednn_linear(x, packed, bias)
    if (
        x.dim() == 2
        and x.shape[0] <= SKINNY_MAX_ROWS
        and kernels.fused_ops
        and _kernel_fits(x, weight)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    ):
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
        load().skinny_linear(out, x, weight)
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) in bf16 on AMX tiles, W packed by `model/layers/amx_tiles.py`."""
    return _tile_layout_linear(load().amx_linear, x, packed, bias)


def bf16_dot_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) in bf16 on AVX512-BF16 dot products, W packed by
    `model/layers/amx_tiles.py`."""
    return _tile_layout_linear(load().bf16_dot_linear, x, packed, bias)


def _tile_layout_linear(
    kernel: Callable[..., None], x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.stride(-1) != 1:  # the kernels read rows in place, at any row stride
        x = x.contiguous()
    out = torch.empty((x.shape[0], packed.shape[0] * packed.shape[3]), dtype=x.dtype)
    kernel(out, x, packed, None if bias is None else bias.float())
    return out


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) on oneDNN, W prepacked by `model/layers/onednn.py`'s `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def silu_and_mul(x: torch.Tensor, kernels: KernelSelection = TORCH_KERNELS) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    d = x.shape[-1] // 2
    if kernels.fused_ops and _elementwise_fits(x) and x.dim() == 2 and x.stride(-1) == 1:
        out = torch.empty((x.shape[0], d), dtype=x.dtype)
        load().silu_and_mul(out, x)
        return out
    return F.silu(x[..., :d]) * x[..., d:]


# Gemma's transcendental element-wise work. Eager, it is ATen's ops called from here
# (through the kernel, its output allocation and checks cost ~5 us more a call). In a
# compiled graph it is that kernel: the graph would otherwise generate its own tanh, whose
# last bits differ from ATen's, and the compiled step would leave the eager step's tokens.


def gelu_tanh_and_mul(x: torch.Tensor, kernels: KernelSelection = TORCH_KERNELS) -> torch.Tensor:
    """gelu_tanh(gate) * up for x = [gate | up] along the last dimension (Gemma's MLP)."""
    d = x.shape[-1] // 2
    if torch.compiler.is_compiling() and kernels.fused_ops and x.dim() == 2 and x.is_cpu:
        out = torch.empty((x.shape[0], d), dtype=x.dtype)
        load().gelu_tanh_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(
    logits: torch.Tensor, cap: float, kernels: KernelSelection = TORCH_KERNELS
) -> torch.Tensor:
    """tanh(logits / cap) * cap, computed in place in `logits` (op for op the same bits as
    the out-of-place expression, without two vocabulary-sized temporaries a step)."""
    if torch.compiler.is_compiling() and kernels.fused_ops and logits.is_cpu:
        load().soft_cap(logits, cap)
        return logits
    return logits.div_(cap).tanh_().mul_(cap)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kernels: KernelSelection = TORCH_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, Hkv, D]; the kernel rotates in place
    (q and k may be strided views into the fused q/k/v output)."""
    if (
        kernels.fused_ops
        and _elementwise_fits(q, k)
        and _kernel_fits(cos_cache, sin_cache)
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and positions.dtype == torch.int64
    ):
        load().rotary_embedding(q, k, positions.contiguous(), cos_cache, sin_cache)
        return q, k
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sample_plain(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    uniforms: torch.Tensor,
    kernels: KernelSelection = TORCH_KERNELS,
) -> torch.Tensor:
    """One token per row from softmax(logits * inv_temperature), by inverse CDF with the
    row's uniform number; -inf logits are never drawn."""
    if (
        kernels.sampler_draw
        and _kernel_fits(logits, inv_temperature, uniforms)
        and logits.dim() == 2
    ):
        token_ids = torch.empty(logits.shape[0], dtype=torch.int64)
        load().sample_plain(
            token_ids,
            logits if logits.stride(-1) == 1 else logits.contiguous(),
            inv_temperature.contiguous(),
            uniforms.contiguous(),
        )
        return token_ids
    probs = (logits * inv_temperature[:, None]).softmax(dim=-1)
    return inverse_cdf(probs, uniforms)


def greedy_pick(logits: torch.Tensor, kernels: KernelSelection = TORCH_KERNELS) -> torch.Tensor:
    """logits.argmax(dim=-1) of 2-D logits: each row's first maximum, a NaN above every
    number. The kernel finds the maximum, then its first occurrence (~0.06 ms over Gemma 3's
    262k logits, where torch's indexed reduction takes ~0.65 ms a row)."""
    if (
        kernels.sampler_draw
        and _kernel_fits(logits)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(-1) == 1
    ):
        token_ids = torch.empty(logits.shape[0], dtype=torch.int64)
        load().argmax_rows(token_ids, logits)
        return token_ids
    return logits.argmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of (unnormalized) `probs` with one uniform number per row.

    One random number per row instead of one per token: drawing a Gumbel or exponential
    variate for every vocabulary entry costs more than the rest of sampling together.
    """
    cdf = probs.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    index = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)
