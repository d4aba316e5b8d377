"""The embedding table and LM head of a checkpoint stored quantized, held in the checkpoint's
own 16-bit dtype (fp16 or bf16) while the model computes in float32.

Quantized models compute in float32, and held as fp32 a 16-bit embedding and its tied head
took twice the bytes the checkpoint stores: at Llama-3.2-1B's shape 1.05 GB against 0.525 GB,
which put the whole model at 1.35-1.52x its checkpoint's tensor bytes. Every fp16 and bf16
value is an fp32 value, so nothing is rounded: the lookup gathers 16-bit rows and converts
them (`VocabParallelEmbedding.compute_dtype`). `StoredDtypeHead` multiplies up to
`fused.SKINNY_MAX_ROWS` rows on the skinny kernel, which converts each 16-bit weight vector
to fp32 in registers and sums in the fp32 weight's order: half the bytes read, and below
`fused.PACKED_MIN_ROWS` rows (decode of a few sequences, each prefill's last rows), where
the fp32 head took that kernel too, the fp32 head's logits bit for bit. From there the fp32
head ran on oneDNN's packed fp32 copy, a third copy of the vocabulary this head does not
keep, whose sums differ from the skinny kernel's by rounding alone. More rows convert a band
of 1 MiB of rows at a time into a shared fp32 buffer and multiply it on torch's sgemm.

Under tensor parallelism the 16-bit weight is this rank's rows of the padded vocabulary, as
the fp32 one was (`VocabShard`). GGUF checkpoints keep their own blocks (gguf_embedding.py).
PAGEDLLM_STORED_VOCAB=0 holds the vocabulary in fp32 as before.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.linear import (
    Linear,
    MatmulIntoLinear,
    default_weight_loader,
    set_weight_loader,
)
from pagedllm.model.layers.vocab_parallel import VocabParallelEmbedding, VocabShard
from pagedllm.model.layers.w8a8_linear import BAND_BYTES, _scratch
from pagedllm.ops import fused
from pagedllm.ops.extension import load
from pagedllm.ops.kernel_selection import KernelSelection

_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def stored_vocab_enabled() -> bool:
    return os.environ.get("PAGEDLLM_STORED_VOCAB", "1") != "0"


def _header(file: Path) -> dict[str, Any]:
    with open(file, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        return json.loads(stream.read(length))


def stored_vocab_dtype(directory: str | None, hf_config: Any) -> torch.dtype | None:
    """The 16-bit dtype the checkpoint stores its embedding (or head) in, read from the
    safetensors headers; without files (dummy weights) the config's dtype; None when that is
    not fp16 or bf16."""
    files = sorted(Path(directory).glob("*.safetensors")) if directory else []
    for file in files:
        header = _header(file)
        for name in _VOCAB_TENSORS:
            if name in header:
                return _SAFETENSORS_DTYPES.get(header[name]["dtype"])
    stored = getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.float16, torch.bfloat16) else None


def _retyped(param: nn.Parameter, dtype: torch.dtype, loader) -> nn.Parameter:
    """An empty parameter of `param`'s shape in `dtype`, loaded by `loader`, narrowing lazy
    slices where `param` did."""
    retyped = nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
    if getattr(param, "narrows", False):
        retyped.narrows = True  # type: ignore[attr-defined]
    return set_weight_loader(retyped, loader)


class StoredDtypeHead(MatmulIntoLinear):
    """fp32 logits from a 16-bit [vocab rows, hidden] weight converted a band at a time; with
    a `shard` (tensor parallelism) this rank's rows, gathered as `ParallelLMHead` does."""

    def __init__(
        self, weight: nn.Parameter, shard: VocabShard | None, kernels: KernelSelection
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None
        self.shard = shard
        self.kernels = kernels
        self.out_features, self.in_features = weight.shape
        self.band_rows = max(1, BAND_BYTES // (4 * self.in_features))

    def matmul_into(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        if self.kernels.fused_ops and x2.shape[0] <= fused.SKINNY_MAX_ROWS:
            # Converted in registers: half the bytes read, the fp32 kernel's sums.
            load().skinny_linear(out, x2, self.weight)
            return
        for start in range(0, self.out_features, self.band_rows):
            stop = min(start + self.band_rows, self.out_features)
            band = _scratch(stop - start, self.in_features).copy_(self.weight[start:stop])
            out[:, start:stop] = fused.linear(x2, band, None, self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = super().forward(x)
        if self.shard is None or self.shard.tp_group.world_size == 1:
            return logits
        return self.shard.gather_logits(logits)

    def extra_repr(self) -> str:
        features = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{features}, {self.weight.dtype}"


def keep_vocab_in_stored_dtype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Before the weights load: the fp32 embedding and head of `model` (tied or not) become
    `dtype` ones; False where the model holds neither in fp32 (nothing changes)."""
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    changed = False
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if isinstance(embedding, VocabParallelEmbedding) and embedding.weight.dtype == torch.float32:
        embedding.weight = _retyped(embedding.weight, dtype, embedding.weight_loader)
        changed = True
    if isinstance(head, Linear) and head.weight.dtype == torch.float32 and head.bias is None:
        shard = getattr(head, "shard", None)
        if tied and changed:
            weight = embedding.weight
        else:
            loader = default_weight_loader if shard is None else shard.load
            weight = _retyped(head.weight, dtype, loader)
        model.lm_head = StoredDtypeHead(weight, shard, head.kernels)
        changed = True
    return changed
