"""A quantized checkpoint's 16-bit embedding and head held in their stored dtype
(model/layers/stored_vocab.py): the fp32 model's rows and logits, bit for bit, in half the
bytes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.parallel_memory import LlamaShape
from benchmarks.quantized_checkpoints import (
    checkpoint_tensor_bytes,
    held_weight_bytes,
    write_checkpoint,
)
from benchmarks.quantized_real_size import engine_options
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.layers import vocab_parallel
from pagedllm.model.layers.linear import Linear
from pagedllm.model.layers.stored_vocab import (
    StoredDtypeHead,
    keep_vocab_in_stored_dtype,
    stored_vocab_dtype,
)
from pagedllm.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from pagedllm.ops import fused
from pagedllm.ops.kernel_selection import select_kernels

TIED = LlamaShape("tiny", 256, 512, 2, 4, 2, 512, tie_word_embeddings=True)
UNTIED = LlamaShape("tiny-untied", 256, 512, 2, 4, 2, 512)
# Written with the rest fp16 (GPTQ) and bf16 (FP8) by the benchmarks' random writers.
STORED = {"gptq-g128": torch.float16, "fp8-block": torch.bfloat16}


def _kernels():
    return select_kernels(
        "cpu", torch.float32, "cpu", head_dim=64, cache_dtype=torch.float32
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, fused.PACKED_MIN_ROWS - 1])
def test_the_head_multiplies_the_fp32_heads_values_bit_for_bit(dtype, rows):
    # 2,048 inputs: 128-row bands, and 1,000 rows leave a short last band.
    vocab, hidden = 1000, 2048
    weight = torch.randn(vocab, hidden).to(dtype)
    kernels = _kernels()
    reference = Linear(hidden, vocab, False, torch.float32, kernels)
    reference.weight.data.copy_(weight)
    head = StoredDtypeHead(torch.nn.Parameter(weight, requires_grad=False), None, kernels)
    assert head.band_rows == 128
    x = torch.randn(rows, hidden)
    logits = head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, reference(x))


def test_the_embedding_converts_the_rows_it_gathers():
    embedding = VocabParallelEmbedding(300, 64, torch.float32)
    stored = torch.randn(300, 64).to(torch.bfloat16)
    embedding.weight = torch.nn.Parameter(stored, requires_grad=False)
    ids = torch.tensor([0, 299, 7, 7])
    rows = embedding(ids)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, stored.float()[ids])


class _StandInGroup(GroupCoordinator):
    """Rank `rank` of a `tp`-rank group, in this process: its all-reduce and gather return
    this rank's own tensor (the test joins the ranks' parts itself)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__(list(range(tp)), rank, torch.device("cpu"))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor:
        return tensor


class _Vocab(torch.nn.Module):
    """The embedding and head as a Llama model holds them."""

    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, torch.float32)
        self.lm_head = ParallelLMHead(vocab, hidden, torch.float32, _kernels())
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load(self, embedding: torch.Tensor, head: torch.Tensor) -> None:
        for param, tensor in (
            (self.model.embed_tokens.weight, embedding),
            (self.lm_head.weight, head),
        ):
            param.weight_loader(param, tensor.to(param.dtype))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_each_rank_holds_its_16_bit_rows_and_computes_its_fp32_logits(monkeypatch, tied):
    vocab, hidden, dtype = 300, 64, torch.bfloat16  # 2 ranks: 192 rows each, 84 of padding
    embedding, head = (torch.randn(vocab, hidden).to(dtype) for _ in range(2))
    if tied:
        head = embedding
    ids, x = torch.tensor([0, 150, 191, 192, 299]), torch.randn(2, hidden)
    looked_up = torch.zeros(len(ids), hidden)
    for rank in range(2):
        group = _StandInGroup(rank, 2)
        monkeypatch.setattr(vocab_parallel, "get_tp_group", lambda group=group: group)
        reference, stored = _Vocab(vocab, hidden, tied), _Vocab(vocab, hidden, tied)
        assert keep_vocab_in_stored_dtype(stored, dtype)
        reference.load(embedding, head)
        stored.load(embedding, head)
        assert stored.lm_head.weight.dtype == dtype and stored.lm_head.weight.shape == (192, 64)
        assert torch.equal(stored.lm_head.weight.float(), reference.lm_head.weight)
        assert torch.equal(stored.lm_head(x), reference.lm_head(x))  # this rank's columns
        rows = stored.model.embed_tokens(ids)
        assert torch.equal(rows, reference.model.embed_tokens(ids))
        looked_up += rows
    assert torch.equal(looked_up, embedding.float()[ids])


def _engine(path, fmt: str) -> LLM:
    return LLM(
        str(path), max_model_len=64, kv_cache_memory="8MiB", skip_tokenizer_init=True,
        **engine_options(str(path), fmt),
    )  # fmt: skip


def _greedy(llm: LLM) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": [1, 2, 3, 90, 17]}
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
    return list(out.token_ids), logprobs


@pytest.mark.slow
@pytest.mark.parametrize("shape", [TIED, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("fmt", list(STORED))
def test_the_engine_holds_the_checkpoints_bytes_and_decodes_the_same(
    tmp_path, monkeypatch, fmt, shape
):
    path = write_checkpoint(tmp_path / fmt, shape, fmt)
    assert stored_vocab_dtype(str(path), None) == STORED[fmt]
    monkeypatch.setenv("PAGEDLLM_STORED_VOCAB", "0")
    fp32_llm = _engine(path, fmt)
    expected = _greedy(fp32_llm)
    fp32_bytes = held_weight_bytes(fp32_llm.model_runner.model)
    del fp32_llm
    monkeypatch.setenv("PAGEDLLM_STORED_VOCAB", "1")
    llm = _engine(path, fmt)
    model = llm.model_runner.model
    assert isinstance(model.lm_head, StoredDtypeHead)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == STORED[fmt]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == shape.tie_word_embeddings
    # Greedy tokens and every logprob as the fp32-held vocabulary gave them.
    assert _greedy(llm) == expected
    stored = checkpoint_tensor_bytes(path, shape, fmt)["all"]
    held = held_weight_bytes(model)
    assert held < fp32_bytes
    assert 0.9 * stored <= held <= 1.1 * stored, (held, stored, fp32_bytes)
