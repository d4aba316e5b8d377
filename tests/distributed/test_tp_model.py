"""Tensor- and pipeline-parallel Llama: every rank's forward (gloo + shared-memory all-reduce
between spawned processes) gives the single-process model's logits, on the sampling rank only.

Configurations: KV heads 1 (replicated over 2 ranks), 2 and 4, a 509-token vocabulary (padded
to 512: the shard boundary at id 256 is in the prompt), Qwen2's q/k/v bias, tied embeddings
with every bias; checkpoints read lazily from safetensors (each rank reads its shard only).
"""

from __future__ import annotations

import pytest
import torch
from tp_harness import (
    build_model,
    checkpoint_tensors,
    run_ranks,
    run_steps,
    tiny_config,
)

CASES = {
    "kv1": dict(num_key_value_heads=1),
    "kv2": dict(),
    "kv4": dict(num_key_value_heads=4),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"]),
    "tied-bias": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
}
# Ids on both sides of the vocabulary shard boundary (256) and the last real id (508).
PROMPT = [5, 17, 508, 3, 250, 255, 256, 257, 100]
DECODE = [507, 0, 256]
ATOL = 2e-4  # fp32 partial sums in another order


def _reference(name: str) -> list[torch.Tensor]:
    config = tiny_config(**CASES[name])
    model = build_model(config)
    model.load_weights(checkpoint_tensors(config).items())
    return run_steps(model, config, PROMPT, DECODE)


def _ranks_forward(rank, world_size, tp, pp, names, checkpoint_root):
    from pagedllm.distributed.parallel_state import initialize_model_parallel
    from pagedllm.model.loader import ModelSource, load_weights

    initialize_model_parallel(tp, pp)
    results = {}
    for name in names:
        config = tiny_config(**CASES[name])
        model = build_model(config)
        if checkpoint_root is None:
            model.load_weights(checkpoint_tensors(config).items())
        else:
            source = ModelSource(f"{checkpoint_root}/{name}", is_gguf=False)
            load_weights(model, source, config, lazy=True)
        params = sum(p.numel() for p in model.parameters())
        results[name] = (run_steps(model, config, PROMPT, DECODE), params)
    return results


def _check(results, names, output_rank):
    for name in names:
        reference = _reference(name)
        full_params = sum(
            t.numel() for t in checkpoint_tensors(tiny_config(**CASES[name])).values()
        )
        for rank, per_rank in enumerate(results):
            logits, params = per_rank[name]
            assert params < full_params, f"{name}: rank {rank} holds the whole model"
            if rank != output_rank:
                assert all(step is None for step in logits), f"rank {rank} got logits"
                continue
            assert len(logits) == len(reference)
            for step, (got, want) in enumerate(zip(logits, reference, strict=True)):
                assert got.shape == want.shape == (1, 509)
                torch.testing.assert_close(
                    got, want, atol=ATOL, rtol=1e-4, msg=f"{name} step {step}"
                )


def test_tp2_matches_single_process(tmp_path):
    from safetensors.torch import save_file

    for name, overrides in CASES.items():
        (tmp_path / name).mkdir()
        save_file(
            checkpoint_tensors(tiny_config(**overrides)), tmp_path / name / "model.safetensors"
        )
    names = list(CASES)
    results = run_ranks(_ranks_forward, 2, 2, 1, names, str(tmp_path), timeout_s=90)
    _check(results, names, output_rank=0)


def test_pp2_matches_single_process():
    # 3 layers: stage 0 runs two, stage 1 one; the tied head's last stage loads its own copy.
    names = ["kv2", "tied-bias"]
    results = run_ranks(_ranks_forward, 2, 1, 2, names, None, timeout_s=90)
    _check(results, names, output_rank=1)


@pytest.mark.parametrize("shm", ["1", "0"])
def test_tp2_pp2_matches_single_process(shm):
    names = ["kv1"]
    results = run_ranks(
        _ranks_forward, 4, 2, 2, names, None, timeout_s=120, env={"PAGEDLLM_SHM_ALLREDUCE": shm}
    )
    _check(results, names, output_rank=2)
