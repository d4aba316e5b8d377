"""LongRoPE and partial rotation in `layers/rotary.py` against Transformers: the frequencies
and attention factor of its rope init function, the cos/sin its Phi-3 rotary gives on each
side of the original context, and the rotated q/k; the legacy `su` name and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from pagedllm.model.layers.rotary import (
    RotaryEmbedding,
    attention_factor,
    compute_inv_freq,
    rope_parameters,
    rotary_dim,
)
from pagedllm.ops.kernel_selection import select_kernels

HEAD_DIM = 16
ORIGINAL = 64


def _factors(num: int, first: float, step: float) -> list[float]:
    return [first + step * i for i in range(num)]


def _phi3_config(partial: float = 1.0, **rope_extra) -> Phi3Config:
    num_frequencies = int(HEAD_DIM * partial) // 2
    return Phi3Config(
        vocab_size=64,
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": _factors(num_frequencies, 1.0, 0.3),
            "long_factor": _factors(num_frequencies, 2.0, 1.7),
            **rope_extra,
        },
    )


CASES = {
    "full": {},
    "partial": {"partial": 0.75},
    "attention-factor": {"attention_factor": 1.3},
    "factor": {"partial": 0.5, "factor": 3.0},
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = _phi3_config(**CASES[case])
    params = rope_parameters(config)
    dim = rotary_dim(HEAD_DIM, params)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, hf_scale = init(config, None)
    long, _ = init(config, None, seq_len=ORIGINAL + 1)
    assert not torch.equal(short, long)
    assert torch.equal(compute_inv_freq(dim, params, max_position=ORIGINAL), short)
    assert torch.equal(compute_inv_freq(dim, params, max_position=ORIGINAL + 1), long)
    assert attention_factor(params) == pytest.approx(hf_scale, rel=1e-12)
    assert hf_scale != 1.0


@pytest.mark.parametrize("max_position", [ORIGINAL, ORIGINAL + 40])
def test_cos_sin_equal_transformers_on_either_side_of_the_original_context(max_position):
    """Transformers picks the factors per call from its longest position; a call over every
    position below `max_position` is on the side the engine-wide rule picks."""
    config = _phi3_config(partial=0.75)
    hf_rotary = Phi3RotaryEmbedding(config)
    x = torch.zeros(1)
    hf_cos, hf_sin = hf_rotary(x, torch.arange(max_position)[None])
    ours = RotaryEmbedding(HEAD_DIM, max_position, rope_parameters(config))
    torch.testing.assert_close(ours.cos_cache, hf_cos[0], rtol=0, atol=1e-7)
    torch.testing.assert_close(ours.sin_cache, hf_sin[0], rtol=0, atol=1e-7)


def test_partial_rotation_equals_transformers_with_the_engines_kernels():
    """12 of 16 dimensions rotate, the last 4 pass through; q and k are strided views of a
    fused q/k/v output, as the model hands them over."""
    config = _phi3_config(partial=0.75)
    tokens, heads, kv_heads, max_position = 9, 4, 2, 100
    kernels = select_kernels(
        "cpu", torch.float32, "cpu", head_dim=HEAD_DIM, cache_dtype=torch.float32
    )
    rotary = RotaryEmbedding(HEAD_DIM, max_position, rope_parameters(config), kernels)
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM)
    q, k, _ = qkv.view(tokens, -1, HEAD_DIM).split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.tensor([0, 1, 2, 7, 30, 63, 64, 65, 99])
    hf_cos, hf_sin = Phi3RotaryEmbedding(config)(torch.zeros(1), torch.arange(max_position)[None])
    # Transformers' layout: [batch, heads, tokens, D], cos/sin [batch, tokens, rotary dim].
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[:, positions], hf_sin[:, positions]
    )
    pass_through = q[..., 12:].clone()
    got_q, got_k = rotary(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., 12:], pass_through)


def test_legacy_su_config_reads_as_longrope():
    """A config as the first Phi-3 checkpoints wrote it, read without Transformers'
    standardization: `rope_scaling` of type `su`, the original context beside it."""
    legacy = SimpleNamespace(
        rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        rope_theta=500.0,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
    )
    params = rope_parameters(legacy)
    assert params["rope_type"] == "longrope"
    assert params["rope_theta"] == 500.0
    assert params["partial_rotary_factor"] == 1.0
    assert params["original_max_position_embeddings"] == ORIGINAL
    assert params["factor"] == 4.0
    assert rotary_dim(HEAD_DIM, params) == HEAD_DIM


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"short_factor": [1.0] * 7}, "short_factor must list 8 factors"),
        ({"long_factor": None}, "long_factor must list 8 factors"),
        ({"rope_type": "yarn"}, "rope_type 'yarn' is not supported"),
        ({"partial_rotary_factor": 0.7}, "supported: a factor in"),
    ],
)
def test_unsupported_rope_settings_are_refused(change, message):
    params = rope_parameters(_phi3_config())
    params.update(change)
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(HEAD_DIM, ORIGINAL, params)
