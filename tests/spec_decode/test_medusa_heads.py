"""Medusa heads on a tiny random target, with random heads written in both published layouts
(tests/medusa_writer.py): loading, greedy output equal to no speculation (under chunked
prefill and preemption, prefix caching, n > 1, structured output, LoRA), seeded sampling
reproducible, sampled drafts under rejection sampling distributed as the target's, and heads
that copy a bigram target accepting every draft. One engine with heads serves most tests."""

from __future__ import annotations

import numpy as np
import pytest
import spec_checks
import torch
from medusa_writer import write_fasterdecoding_heads, write_vllm_heads
from model_utils import compare_to_reference_engine, greedy_with_logprobs, model_runner
from spec_checks import (
    assert_same_outputs,
    assert_seeded_sample_alone_as_batched,
    assert_structured_output_as_plain,
    engine,
)
from test_rejection_sampler import TARGET_ROWS, assert_frequencies_match, uniform_metadata
from transformers import AutoConfig

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.ops.kernel_selection import TORCH_KERNELS
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.medusa_config import read_medusa_config
from pagedllm.spec_decode.runner.medusa_loading import build_medusa_heads, read_medusa_tensors
from pagedllm.spec_decode.runner.medusa_proposer import MedusaDrafts
from pagedllm.spec_decode.runner.rejection_sampler import rejection_sample, target_probs

PROMPTS = spec_checks.PROMPTS[:4]
MAX_TOKENS = 32


def medusa(directory, num_speculative_tokens: int, **more) -> dict:
    return {
        "method": "medusa",
        "model": str(directory),
        "num_speculative_tokens": num_speculative_tokens,
        **more,
    }


@pytest.fixture(scope="module")
def target_config(tiny_llama):
    return AutoConfig.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def heads(target_config, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("medusa-heads")
    return {
        "fasterdecoding": write_fasterdecoding_heads(root / "fd", target_config, num_heads=4),
        "vllm": write_vllm_heads(root / "vllm", target_config, num_heads=3, num_layers=2),
    }


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return greedy_with_logprobs(engine(tiny_llama), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return engine(tiny_llama)


@pytest.fixture(scope="module")
def spec(tiny_llama, heads) -> LLM:
    """FasterDecoding's heads, three of its four drafting."""
    return engine(tiny_llama, medusa(heads["fasterdecoding"], 3))


# ---- loading ----------------------------------------------------------------------------


def _reference_logits(blocks, lm_head, hidden):
    x = hidden
    for weight, bias in blocks:
        x = x + torch.nn.functional.silu(x @ weight.T + (0 if bias is None else bias))
    return x @ lm_head.T


def _load(directory, num_heads, target_config, shared_logits=None):
    config = read_medusa_config(str(directory))
    tensors = read_medusa_tensors(str(directory), config)
    built = build_medusa_heads(
        config,
        tensors,
        num_heads,
        target_config.hidden_size,
        target_config.vocab_size,
        torch.float32,
        TORCH_KERNELS,
    )
    if shared_logits is not None:
        built.share_target_logits(shared_logits)
    return built


def test_fasterdecoding_layout_computes_its_heads(target_config, tmp_path):
    """Each head: x + SiLU(W x + b) per block, then its own lm_head; both of
    FasterDecoding's file forms; only the heads asked for are built."""
    for pickled in (True, False):
        directory = write_fasterdecoding_heads(
            tmp_path / str(pickled), target_config, num_heads=4, num_layers=2, pickled=pickled
        )
        built = _load(directory, 3, target_config)
        assert built.num_heads == 3 and built.lm_head_of == [0, 1, 2]
        written = torch.load(directory / "medusa_lm_head.pt") if pickled else None
        if written is None:
            from safetensors.torch import load_file

            written = load_file(directory / "medusa_lm_head.safetensors")
        hidden = torch.randn(5, target_config.hidden_size)
        for head, logits in enumerate(built(hidden)):
            blocks = [
                (written[f"{head}.{j}.linear.weight"], written[f"{head}.{j}.linear.bias"])
                for j in range(2)
            ]
            want = _reference_logits(blocks, written[f"{head}.2.weight"], hidden)
            assert torch.allclose(logits, want, atol=1e-4)


def test_vllm_layout_shares_an_lm_head_or_the_targets(target_config, tmp_path):
    """vLLM's layout: blocks without a bias; `original_lm_head` scores every head with
    lm_heads.0; without lm_heads the target's scores."""
    from safetensors.torch import load_file

    shared = write_vllm_heads(tmp_path / "shared", target_config, original_lm_head=True)
    built = _load(shared, 3, target_config)
    assert built.lm_head_of == [0, 0, 0] and len(built.lm_heads) == 1
    assert built.blocks[0].layers[0].bias is None
    written = load_file(shared / "model.safetensors")
    hidden = torch.randn(4, target_config.hidden_size)
    blocks = [(written[f"blocks.2.layers.{j}.weight"], None) for j in range(2)]
    want = _reference_logits(blocks, written["lm_heads.0.weight"], hidden)
    assert torch.allclose(built(hidden)[2], want, atol=1e-4)

    bare = write_vllm_heads(tmp_path / "bare", target_config, own_lm_heads=False, bias=True)
    target_lm_head = torch.randn(target_config.vocab_size, target_config.hidden_size)
    built = _load(bare, 2, target_config, shared_logits=lambda x: x @ target_lm_head.T)
    assert built.lm_head_of == [None, None]
    written = load_file(bare / "model.safetensors")
    blocks = [
        (written[f"blocks.1.layers.{j}.weight"], written[f"blocks.1.layers.{j}.bias"])
        for j in range(2)
    ]
    want = _reference_logits(blocks, target_lm_head, hidden)
    assert torch.allclose(built(hidden)[1], want, atol=1e-4)


def test_the_engine_drafts_with_the_heads_asked_for(spec):
    proposer = model_runner(spec).proposer
    assert isinstance(proposer, MedusaDrafts) and proposer.heads.num_heads == 3
    assert model_runner(spec).draft_kv_pool == []  # position-wise heads: no KV of their own


@pytest.mark.parametrize(
    ("overrides", "k", "message"),
    [
        ({}, 4, "has 3 heads"),
        ({"hidden_size": 32}, 2, "hidden_size 32"),
        ({"truncated_vocab_size": 100}, 2, "truncated vocabulary"),
    ],
)
def test_what_does_not_fit_the_target_is_refused(
    tiny_llama, target_config, tmp_path, overrides, k, message
):
    directory = write_vllm_heads(tmp_path / "heads", target_config, **overrides)
    with pytest.raises(ValueError, match=message):
        engine(tiny_llama, medusa(directory, k))


def test_refused_by_name(heads):
    with pytest.raises(ValueError, match="head's directory"):
        SpeculativeConfig.parse({"method": "medusa", "num_speculative_tokens": 2})
    config = SpeculativeConfig.parse(medusa("x", 2, draft_tensor_parallel_size=1))
    assert config.num_lookahead_tokens == 0 and config.uses_head


# ---- exactness --------------------------------------------------------------------------


def test_greedy_equals_no_speculation(spec, reference, report_ties):
    actual = greedy_with_logprobs(spec, PROMPTS, MAX_TOKENS)
    ties, _ = compare_to_reference_engine(reference, actual, tie_tolerance=1e-4)
    report_ties(ties, len(PROMPTS))
    assert spec.get_stats().spec_decode.num_drafts > 0


@pytest.mark.slow  # ~16 s on two busy cores; the heads keep no KV that preemption could touch
def test_greedy_equals_no_speculation_chunked_and_preempted(
    tiny_llama, heads, reference, report_ties
):
    """vLLM's layout, prompts prefilled in chunks and a pool too small for every request."""
    layout = {"max_num_batched_tokens": 16, "max_model_len": 96, "kv_cache_memory": 10 * 8192}
    llm = engine(tiny_llama, medusa(heads["vllm"], 3), **layout)
    actual = greedy_with_logprobs(llm, PROMPTS, MAX_TOKENS)
    ties, _ = compare_to_reference_engine(reference, actual, tie_tolerance=1e-4)
    report_ties(ties, len(PROMPTS))
    stats = llm.get_stats()
    assert stats.spec_decode.num_drafts > 0 and stats.num_preemptions > 0


def test_prefix_hits_parallel_samples_and_seeds(plain, spec):
    """Prompts again (prefix-cache hits), n = 3, and a seeded request sampling the same
    tokens whatever else is in the batch."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    hits_before = spec.get_stats().prefix_cache_hits
    for params in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, n=3, ignore_eos=True),
    ):
        assert_same_outputs(plain, spec, prompts, params)
    assert spec.get_stats().prefix_cache_hits > hits_before
    assert_seeded_sample_alone_as_batched(spec, max_tokens=12)


def test_structured_output_with_medusa(plain, spec):
    assert_structured_output_as_plain(plain, spec)


def test_medusa_proposes_for_lora_requests(tiny_llama, heads, tmp_path):
    """The heads read the hidden states of the target with each request's adapter; the
    target verifies: tokens as without speculation."""
    from lora_utils import make_peft_adapter

    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", seed=7)
    loras = [None, LoRARequest("a", 1, str(adapter))]
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 2
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = engine(tiny_llama, enable_lora=True).generate(
        prompts, params, use_tqdm=False, lora_request=loras
    )
    spec = engine(tiny_llama, medusa(heads["vllm"], 2), enable_lora=True)
    got = spec.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert want[0].outputs[0].token_ids != want[1].outputs[0].token_ids  # the adapter counts
    assert spec.get_stats().spec_decode.num_drafts > 0


# ---- sampling ---------------------------------------------------------------------------


class _Batch:
    """What MedusaDrafts reads of the runner's batch: rows of N tokens, temperature 1."""

    def __init__(self, num_rows: int, num_tokens: int) -> None:
        self.num_tokens = np.full(num_rows, num_tokens)
        self.temperature = np.ones(num_rows, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}

    def row(self, request_id: str) -> int:
        return int(request_id)


def test_sampled_drafts_keep_the_target_distribution(target_config, heads):
    """Two heads' drafts drawn from their softmax, with the q the proposer hands over,
    verified by the rejection sampler: the tokens emitted follow the target's
    distribution."""
    built = _load(heads["vllm"], 2, target_config)
    # An 8-token vocabulary (the lm_heads' first rows), flattened so that drafts are often
    # accepted and the second token is emitted often enough to count.
    for lm_head in built.lm_heads:
        lm_head.weight.data = lm_head.weight.data[:8] * 0.05
    config = SpeculativeConfig.parse(medusa("x", 2))
    proposer = MedusaDrafts(config, built, torch.device("cpu"))
    num_trials, num_tokens = 4000, 10
    ids = [str(i) for i in range(num_trials)]
    # Each request's step computed positions 7..8: position N - 2 = 8 is its second row.
    state = torch.randn(1, target_config.hidden_size)
    states = torch.cat([torch.zeros(1, target_config.hidden_size), state]).repeat(num_trials, 1)
    proposer.observe_target(ids, np.full(num_trials, 7), np.full(num_trials, 2), states)
    torch.manual_seed(5)
    drafts = proposer.propose(ids, _Batch(num_trials, num_tokens))
    request_drafts = [drafts[r] for r in ids]
    q = proposer.draft_probs(ids, request_drafts)
    assert q[0].shape == (2, 8)
    head_probs = torch.stack([logits[0].softmax(-1) for logits in built(state)])
    assert torch.allclose(q[0], head_probs, atol=1e-5)
    out = rejection_sample(
        TARGET_ROWS.repeat(num_trials, 1), request_drafts, q, uniform_metadata(num_trials, 1.0)
    )
    p = target_probs(TARGET_ROWS, torch.ones(3)).double()
    assert_frequencies_match(torch.tensor([tokens[0] for tokens in out]), p[0])
    second = torch.tensor([tokens[1] for tokens in out if len(tokens) >= 2])
    assert_frequencies_match(second, p[1])


# ---- a head that knows its target -----------------------------------------------------------


def test_heads_that_copy_a_bigram_target_accept_every_draft(tmp_path):
    """A target whose logits at a token depend on that token alone (attention adds nothing)
    emits t -> f(t) greedily; heads whose lm_head maps the normed state of t to f^(i+2)(t)
    (solved exactly: as many hidden features as tokens) and whose blocks are the identity
    propose exactly the target's tokens: every draft is accepted."""
    from model_utils import make_tiny_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    vocab = 128
    directory = make_tiny_model(
        "LlamaForCausalLM",
        tmp_path / "bigram",
        num_hidden_layers=1,
        vocab_size=vocab,
        hidden_size=vocab,
    )
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        out = hf(torch.arange(vocab)[:, None], output_hidden_states=True)
    states = out.hidden_states[-1][:, 0].double()  # [token, hidden], after the final norm
    bigram = out.logits[:, 0].argmax(dim=-1)  # f
    num_heads = 3
    lm_heads, ahead = [], bigram[bigram]  # f(f(t)): what head 0 proposes after t
    for _ in range(num_heads):
        wanted = torch.nn.functional.one_hot(ahead, vocab).double() * 20.0  # [token, vocab]
        lm_heads.append(torch.linalg.solve(states, wanted).T.float().contiguous())
        ahead = bigram[ahead]
    config = AutoConfig.from_pretrained(directory)
    head_dir = write_fasterdecoding_heads(
        tmp_path / "copy", config, num_heads=num_heads, num_layers=0, lm_heads=lm_heads
    )
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    want = greedy_with_logprobs(engine(directory), prompts, 24)
    spec = engine(directory, medusa(head_dir, num_heads))
    got = greedy_with_logprobs(spec, prompts, 24)
    compare_to_reference_engine(want, got, tie_tolerance=1e-4)
    counts = spec.get_stats().spec_decode
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0
