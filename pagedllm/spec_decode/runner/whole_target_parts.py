"""`target_parts`: the target's embedding and logits as a head shares them (`TargetParts`):
the target's own modules on one rank; across ranks, whole copies on the sampling rank, put
together once, at start-up.

A head runs on the sampling rank alone, between steps, so it must call no collective its
peers would wait in: a sharded embedding all-reduces and a sharded lm_head gathers. Under
tensor parallelism each copy is joined from every rank's vocabulary rows; with pipeline
stages the embedding, which only the first stage holds, is joined there and sent to the last
(the lm_head is the last stage's own). The target's hidden states need no such copy: they
are whole on every tensor-parallel rank after each layer's all-reduce. The copies cost the
sampling rank one vocabulary x hidden table, two when it holds neither.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group, get_tp_group, single_rank_groups
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.onednn import pack_linear_weights
from pagedllm.model.layers.vocab_parallel import VocabParallelEmbedding
from pagedllm.ops.kernel_selection import KernelSelection
from pagedllm.spec_decode.runner.eagle_head import TargetParts


def target_parts(
    model: nn.Module, kernels: KernelSelection, needs_embedding: bool
) -> TargetParts | None:
    """What a head shares with `model` on the sampling rank (None on the other ranks);
    `needs_embedding` False: the logits alone (Medusa's heads). Across ranks a collective:
    every rank of the first and last stages calls it, in the same order."""
    tp, pp = get_tp_group(), get_pp_group()
    if tp.world_size == 1 and pp.world_size == 1:
        return TargetParts(model.model.embed_tokens, model.compute_logits)
    embedding = _embedding_on_last_stage(model) if needs_embedding else None
    if not pp.is_last_rank:
        return None
    if tp.world_size == 1:
        logits = model.compute_logits  # the last stage's own, whole
    else:
        _check_plain_logits(model)
        embed = model.model.embed_tokens  # None on a stage after the first
        tied = embed is not None and getattr(model.lm_head, "weight", None) is embed.weight
        # A tied lm_head's rows are the embedding's, joined already when it was needed.
        reuse = tied and needs_embedding
        weight = embedding if reuse else _joined_rows(model.lm_head, "lm_head")
        logits = None if weight is None else _whole_lm_head(weight, kernels)
    if not tp.is_first_rank:
        return None
    with single_rank_groups():  # whole layers, which call no collective
        whole_embed = None if embedding is None else _whole_embedding(model, embedding)
    return TargetParts(whole_embed, logits)


def _embedding_on_last_stage(model: nn.Module) -> torch.Tensor | None:
    """The whole [vocab_size, hidden] embedding table on the last stage's first
    tensor-parallel rank (None elsewhere): joined on the first stage, sent to the last."""
    pp = get_pp_group()
    embed = model.model.embed_tokens
    weight = None
    if pp.is_first_rank:
        weight = _joined_rows(embed, "embedding")
    if pp.world_size == 1 or not get_tp_group().is_first_rank:
        return weight
    config = model.config
    if pp.is_first_rank:
        pp.send(weight.float(), dst=pp.world_size - 1)
        return None
    if not pp.is_last_rank:
        return None
    shape = (config.vocab_size, config.hidden_size)
    return pp.recv(shape, torch.float32, src=0).to(model_dtype(model))


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the last stage's layers compute in (its norm's weight)."""
    return model.model.norm.weight.dtype


def _check_plain_logits(model: nn.Module) -> None:
    """The whole lm_head stands in for `compute_logits`: a target that changes its logits
    after the lm_head (Gemma's soft-capping) is refused."""
    if getattr(model, "final_logit_softcapping", None) is not None:
        raise ValueError(
            "speculative_config: a head beside a tensor-parallel target with "
            "final_logit_softcapping is not served (yet)"
        )


def _joined_rows(module: nn.Module, what: str) -> torch.Tensor | None:
    """The whole [vocab_size, hidden] weight of a vocabulary-parallel `module` on its
    tensor-parallel group's first rank (None on the others); a collective."""
    weight = getattr(module, "weight", None)
    shard = getattr(module, "shard", None)
    if shard is None or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(
            f"speculative_config: a head beside a target on several ranks needs the target's "
            f"{what} as plain vocabulary-parallel rows; it is {type(module).__name__} "
            "(a quantized layer), which is not served (yet)"
        )
    # Sent as fp32: every collective backend carries it.
    joined = shard.tp_group.gather(weight.detach().float(), dst=0, dim=0)
    if joined is None:
        return None
    return joined[: shard.vocab_size].to(weight.dtype).contiguous()


def _whole_embedding(model: nn.Module, weight: torch.Tensor) -> nn.Module:
    vocab_size, hidden_size = weight.shape
    whole = VocabParallelEmbedding(vocab_size, hidden_size, model_dtype(model))
    whole.weight = nn.Parameter(weight, requires_grad=False)
    return whole


def _whole_lm_head(weight: torch.Tensor, kernels: KernelSelection) -> Linear:
    vocab_size, hidden_size = weight.shape
    head = Linear(hidden_size, vocab_size, False, weight.dtype, kernels)
    head.weight = nn.Parameter(weight, requires_grad=False)
    if weight.device.type == "cpu":
        pack_linear_weights(head)  # as the target's own lm_head is
    return head
