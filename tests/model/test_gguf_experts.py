"""A mixture's experts on GGUF blocks (`GGUFGroupedExperts`): the block's output against the
stacked fp32 experts on the weights the blocks dequantize to (32-wide types and K-quants,
gate and up of one type or two, experts that get no token), and the tables it keeps
against the file's bytes. Whole models: tests/model/test_gguf_architectures.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from moe_inputs import TOP_K, hidden_states, routing

from pagedllm.model.layers.fused_moe import GroupedExperts, MoESpec, grouped_experts
from pagedllm.model.layers.gguf_experts import GGUFGroupedExperts, gguf_grouped_experts
from pagedllm.model.layers.gguf_linear import (
    GGUFConcatLinear,
    GGUFMergedLinear,
    kernel_type_of_run,
)

EXPERTS = 4
# Offsets of the fp16 super-block scales in a K-quant block: d (and dmin).
K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _stacked(rows: int, cols: int, qtype: Q, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random experts in `qtype`: (raw [experts, rows, bytes], dequantized [experts, rows,
    cols]). K-quants (gguf cannot quantize to them): random bytes under sensible scales."""
    rng = np.random.default_rng(seed)
    if qtype in K_SCALE_OFFSETS:
        block_bytes, blocks = gguf.constants.GGML_QUANT_SIZES[qtype][1], cols // 256
        raw = rng.integers(0, 256, (EXPERTS * rows, blocks, block_bytes), dtype=np.uint8)
        for offset in K_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(1e-3, 3e-3, (EXPERTS * rows, blocks)).astype(np.float16)
            raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(-1, blocks, 2)
        raw = raw.reshape(EXPERTS * rows, -1)
    else:
        weight = rng.standard_normal((EXPERTS * rows, cols)).astype(np.float32) * 0.2
        raw = gguf.quants.quantize(weight, qtype)
    dequantized = gguf.quants.dequantize(raw, qtype).reshape(EXPERTS, rows, cols)
    return raw.reshape(EXPERTS, rows, -1), torch.from_numpy(dequantized.astype(np.float32))


def _experts(types: tuple[Q, Q, Q], hidden: int, intermediate: int):
    """(GGUF experts, the stacked fp32 weights they dequantize to: gate_up, down)."""
    spec = MoESpec(EXPERTS, TOP_K, hidden, intermediate, True, False)
    gate, gate_w = _stacked(intermediate, hidden, types[0], seed=1)
    up, up_w = _stacked(intermediate, hidden, types[1], seed=2)
    down, down_w = _stacked(hidden, intermediate, types[2], seed=3)
    layer = gguf_grouped_experts(
        GroupedExperts(spec, torch.float32),
        ((types[0], gate), (types[1], up)),
        ((types[2], down),),
    )
    file_bytes = gate.nbytes + up.nbytes + down.nbytes
    return layer, torch.cat([gate_w, up_w], dim=1), down_w, file_bytes


@pytest.mark.parametrize(
    ("types", "hidden", "intermediate"),
    [
        ((Q.Q8_0, Q.Q8_0, Q.Q4_0), 64, 96),  # gate/up in one kernel call
        ((Q.Q4_1, Q.Q8_0, Q.Q5_0), 64, 96),  # gate and up apart; Q5_0 down
        ((Q.Q5_0, Q.Q8_0, Q.Q8_0), 64, 96),  # gate's Q5_0 held as Q8_0: one call
        ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 256, 256),  # Q4_K_M's experts
    ],
)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_experts_on_blocks_equal_the_dequantized_stacked_experts(
    types, hidden, intermediate, num_tokens
):
    layer, gate_up, down, _ = _experts(types, hidden, intermediate)
    assert isinstance(layer, GGUFGroupedExperts)
    kind = GGUFMergedLinear if kernel_type_of_run(types[:2]) else GGUFConcatLinear
    assert all(isinstance(expert, kind) for expert in layer.gate_up)
    x = hidden_states(num_tokens, hidden)
    ids, weights = routing(num_tokens, [0, 2, 3])  # expert 1 gets no token
    want = grouped_experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    got = layer(x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # Within the kernels' two-digit activation quantization, as for a dense GGUF layer.
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error.item() < 1e-3


def test_an_expert_without_tokens_is_never_run(monkeypatch):
    layer, *_ = _experts((Q.Q8_0, Q.Q8_0, Q.Q8_0), 64, 96)
    ran: list[int] = []
    run = layer._expert_ffn
    monkeypatch.setattr(layer, "_expert_ffn", lambda e, rows: ran.append(e) or run(e, rows))
    ids, weights = routing(5, [1, 3])
    layer(torch.randn(5, 64), ids, weights)
    assert ran == [1, 3]


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0)])
def test_experts_keep_about_the_files_bytes(types):
    layer, _, _, file_bytes = _experts(types, 256, 256)
    # Q8_0 keeps q + 128 and no min table (9 bits a weight against the file's 8.5); the
    # K-quants keep their scales widened, a few percent over the file.
    assert file_bytes <= layer.weight_bytes() < 1.1 * file_bytes
    assert layer.missing_shards() == []


def test_experts_trace_whole_for_the_compiled_decode_step():
    # The compiled decode step traces with fullgraph=True: the experts must be one opaque op
    # there (found by the layer's id), not a graph break, with the eager bits.
    layer, *_ = _experts((Q.Q8_0, Q.Q8_0, Q.Q4_0), 64, 96)
    traced = torch.compile(layer, backend="eager", fullgraph=True, dynamic=True)
    for num_tokens in (1, 3):
        x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
        ids, weights = routing(num_tokens, [0, 1, 2, 3])
        with torch.no_grad():
            assert torch.equal(traced(x, ids, weights), layer(x, ids, weights))
