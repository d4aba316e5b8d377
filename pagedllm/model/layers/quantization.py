"""Weight quantization (`quantization="int8"` or `"gguf"`): the quantized layers and the swap.

Owns the list of methods (`quantization="gguf"`, GGUF blocks kept, is `gguf_swap.py`),
`Int8Linear` / `Int8MergedLinear` (per-output-channel symmetric
int8 weights, prepacked once for fbgemm; activations quantized to 8 bits on every call,
per token: each row is scaled by its own max |x| before fbgemm's per-tensor dynamic
quantization) and `quantize_model`, which replaces the `Linear` layers of a loaded fp32
model (decoder projections and the head; the embedding stays fp32) with them.

Why fbgemm's `quantized::linear_dynamic` (benchmarks/int8_speed.py, SmolLM2 shapes, this
CPU, 2 threads): alone it runs at 3.2-6.6x the fp32 matmul from 16 rows up; with the
per-token rescale, one step's matmuls take 3.0x less time at 16-64 rows, 2.4x at 256,
3.1x at 2048 and 5x at 1 row (the head included). `torch.ao.nn.quantized.dynamic.Linear`
is the same kernel behind more Python; onednn's packed weights are slower except for the
head at 256 rows; `torch._int_mm` is slower everywhere, and `torch._weight_int8pack_mm`
is 30-40x slower than fp32.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagedllm.config import INT8_ENGINE, verify_quantization
from pagedllm.model.layers.linear import Linear, MergedLinear, SplitOutputs
from pagedllm.model.layers.parallel_linear import RowParallelLinear
from pagedllm.model.layers.vocab_parallel import ParallelLMHead

logger = logging.getLogger("pagedllm")

_ENGINE = INT8_ENGINE


def reduce_range() -> bool:
    """Whether activations must use 7 bits instead of 8.

    fbgemm's kernels without VNNI add pairs of u8 x s8 products in saturating int16
    (vpmaddubsw), which 8-bit activations can overflow; VNNI (vpdpbusd) accumulates in
    int32, so the full range is safe there. Unknown CPUs get the safe choice.
    """
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return not (is_vnni is not None and is_vnni())


@contextmanager
def _quantized_engine(name: str) -> Iterator[None]:
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8 (zero point 0, scale = row max |w| / 127)."""
    weight = weight.detach().to(torch.float32)
    # An all-zero row would get scale 0, which quantize_per_channel refuses.
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch marks quantized tensors deprecated; they are still the only way into
        # fbgemm's prepacked int8 GEMM from Python (pinned torch 2.13).
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)


class Int8Linear(nn.Module):
    """y = s * dequant(quant(x / s) @ W_int8^T) + b, s = each row's max |x|; W prepacked once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.reduce_range = reduce_range()
        # Added after the per-row rescale in forward, so it is kept out of the packed weight.
        bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", bias)
        with _quantized_engine(_ENGINE):
            self._packed = torch.ops.quantized.linear_prepack(quantize_weight(weight), None)

    @classmethod
    def from_float(cls, linear: Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out if self.bias is None else out.add_(self.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias."""
        # fbgemm quantizes its whole input with one min/max. One token with large
        # activations (the first token's are often 10-100x the others') would coarsen every
        # other token's step, and a request's numbers would depend on its batch. Scaling
        # each row to max |x| = 1 first gives every token its own 8-bit range (measured on
        # SmolLM2: mean |logprob error| 0.82 -> 0.12; see benchmarks/int8_accuracy.py).
        if x.shape[0] == 1:
            # A lone row already has its own range; skipping the rescale saves three ops
            # per layer on batch-1 decode, where they cost as much as the matmul.
            out = torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)
        else:
            # abs().amax(): linalg.vector_norm(ord=inf) is 10x slower here.
            scales = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
            out = torch.ops.quantized.linear_dynamic(x / scales, self._packed, self.reduce_range)
            out.mul_(scales)
        return out

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-channel qint8 weight, fp32 bias or None)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.ops.quantized.linear_unpack(self._packed)[0], self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"reduce_range={self.reduce_range}"
        )


class Int8MergedLinear(SplitOutputs, Int8Linear):
    """A fused projection (q/k/v, gate/up) quantized as one matrix; splits like the fp32 one."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, output_sizes: list[int]
    ) -> None:
        super().__init__(weight, bias)
        self.output_sizes = list(output_sizes)

    @classmethod
    def from_float(cls, linear: Linear) -> Int8MergedLinear:
        assert isinstance(linear, MergedLinear)
        layer = cls(linear.weight, linear.bias, linear.output_sizes)
        layer.shard_slices = dict(linear.shard_slices)  # LoRA adapters address its shards
        if hasattr(linear, "shard_sources"):  # and cut their B as its tensor-parallel rows
            layer.shard_sources = dict(linear.shard_sources)
        return layer


class Int8RowParallelLinear(Int8Linear):
    """A row-parallel shard (`RowParallelLinear`): the partial products are summed over the
    tensor-parallel ranks, then the bias, whole on every rank, is added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp_group) -> None:
        super().__init__(weight, bias)
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_group.rank_in_group, tp_group.world_size

    @classmethod
    def from_float(cls, linear: Linear) -> Int8RowParallelLinear:
        assert isinstance(linear, RowParallelLinear)
        return cls(linear.weight, linear.bias, linear.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(self.partial_forward(x))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the all-reduce (as `RowParallelLinear`'s)."""
        return self._matmul(x)

    def reduce_partial(self, out: torch.Tensor) -> torch.Tensor:
        out = self.tp_group.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)


class Int8ParallelLMHead(Int8Linear):
    """A vocabulary shard of the head (`ParallelLMHead`): the full logits on the group's rank
    0, None on the others."""

    def __init__(self, weight: torch.Tensor, shard) -> None:
        super().__init__(weight, None)
        self.shard = shard

    @classmethod
    def from_float(cls, linear: Linear) -> Int8ParallelLMHead:
        assert isinstance(linear, ParallelLMHead)
        return cls(linear.weight, linear.shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shard.gather_logits(self._matmul(x))


def _int8_class(module: Linear) -> type[Int8Linear]:
    """The int8 layer taking `module`'s place (a tensor-parallel shard keeps its collective)."""
    if isinstance(module, ParallelLMHead) and module.tp_size > 1:
        return Int8ParallelLMHead
    if isinstance(module, RowParallelLinear) and module.tp_size > 1:
        return Int8RowParallelLinear
    return Int8MergedLinear if isinstance(module, MergedLinear) else Int8Linear


def quantize_model(model: nn.Module, method: str, quantize_head: bool = True) -> list[str]:
    """Replace every `Linear` of a loaded model with its int8 layer, in place.

    The head is quantized too unless `quantize_head` is false: on W1 that is ~15% more
    throughput (median of 11 paired runs, 2-43%) for +0.008 mean |logprob error|, 0.109 ->
    0.117 (benchmarks/int8_accuracy.py, int8_speed.py).
    A tied head gets an int8 copy of the embedding's weight, which itself stays fp32 for
    the lookup. Per-output-channel scales make each row of a fused weight keep its own
    range, so quantizing q/k/v or gate/up fused equals quantizing them apart. Returns the
    names of the replaced modules. ("gguf" swaps its layers in before loading instead:
    `gguf_swap.keep_gguf_blocks`.)
    """
    verify_quantization(method)
    if method != "int8":
        raise ValueError(f"quantize_model quantizes loaded weights to int8, not {method!r}")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and (quantize_head or name != "lm_head")
    ]
    float_bytes = int8_bytes = 0
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _int8_class(module).from_float(module))
        float_bytes += module.weight.numel() * module.weight.element_size()
        int8_bytes += module.weight.numel()
    names = [name for name, _ in targets]
    logger.info(
        "quantization=%s: %d Linear layers to int8 (%.0f MB of float weights -> %.0f MB)",
        method,
        len(names),
        float_bytes / 1e6,
        int8_bytes / 1e6,
    )
    return names
