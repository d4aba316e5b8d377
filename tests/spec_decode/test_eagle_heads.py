"""EAGLE-3 and EAGLE heads on tiny random targets, with random heads written in each
published layout (tests/eagle_writer.py): loading, greedy output equal to no speculation
(under chunked prefill, preemption, prefix caching, n > 1, structured output), seeded
sampling reproducible, the draft vocabulary's proposals under rejection sampling distributed
as the target's, a head that copies its target accepting every draft, and the target's states
read in the step that computed them (none held past it, chunked prefill and aborts
included). Targets on several ranks: tests/distributed/test_spec_heads_parallel.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from eagle_writer import write_eagle3_head, write_eagle_head
from model_utils import (
    compare_to_reference_engine,
    greedy_with_logprobs,
    make_tiny_model,
    model_runner,
)
from spec_checks import (
    PROMPTS,
    assert_same_outputs,
    assert_seeded_sample_alone_as_batched,
    assert_structured_output_as_plain,
    engine,
)
from test_rejection_sampler import TARGET_ROWS, assert_frequencies_match, uniform_metadata
from transformers import AutoConfig

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.model.hidden_tap import HiddenStateTap
from pagedllm.runner.stage_tap import StageTap
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.runner.eagle_head import Eagle3Head
from pagedllm.spec_decode.runner.eagle_loading import checked_d2t
from pagedllm.spec_decode.runner.eagle_proposer import EagleDrafts
from pagedllm.spec_decode.runner.rejection_sampler import (
    draft_sample,
    rejection_sample,
    target_probs,
)
from pagedllm.spec_decode.runner.step_states import StepStates

MAX_TOKENS = 40
# Under chunked prefill and preemption each step is small, so steps are many: fewer tokens
# still fill the pool past what fits (the test asserts the preemptions).
CHUNKED_MAX_TOKENS = 24
# The tiny target has 2 layers: vLLM's default (2, 1, -1) does not fit it.
AUX_LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, dict]:
    """A speculative_config per head layout."""
    target = AutoConfig.from_pretrained(tiny_llama)
    root = tmp_path_factory.mktemp("eagle-heads")
    eagle3 = write_eagle3_head(root / "eagle3", target, draft_vocab_size=200, aux_layers=AUX_LAYERS)
    shared_vocab = write_eagle3_head(
        root / "eagle3-own-embeddings", target, aux_layers=AUX_LAYERS, own_embeddings=True
    )
    eagle = write_eagle_head(root / "eagle", target, bin_file=True)  # pytorch_model.bin
    return {
        "eagle3": {"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": 3},
        "eagle3-full-vocab": {
            "method": "eagle3",
            "model": str(shared_vocab),
            "num_speculative_tokens": 2,
        },
        "eagle": {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 4},
    }


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    """The target without speculation, shared by the tests that compare against it."""
    return engine(tiny_llama)


@pytest.fixture(scope="module")
def reference(plain):
    return greedy_with_logprobs(plain, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def chunked_reference(plain):
    return greedy_with_logprobs(plain, PROMPTS, CHUNKED_MAX_TOKENS)


@pytest.fixture(scope="module")
def spec_engines(tiny_llama, heads) -> dict[str, LLM]:
    """One engine per head layout with the default settings, shared by the tests (an
    engine's start is most of a test's time); tests count drafts and hits from their own
    start, and reset the prefix cache where a hit would change the path they check."""
    return {name: engine(tiny_llama, config) for name, config in heads.items()}


# ---- loading ----------------------------------------------------------------------------


def test_heads_load_in_each_layout(spec_engines):
    runner = model_runner(spec_engines["eagle3"])
    head = runner.proposer.model
    assert isinstance(runner.proposer, EagleDrafts)
    assert runner.proposer.target_states.layers == tuple(AUX_LAYERS)
    assert runner.model.model.hidden_tap.layers == tuple(AUX_LAYERS)
    assert head.embed_tokens is None and head.draft_vocab_size == 200
    # d2t as written: the draft vocabulary's tokens, in order, among the target's.
    targets = torch.arange(200) + head.d2t
    assert bool((targets[1:] > targets[:-1]).all()) and int(targets[-1]) < 512
    # One layer of KV, of the target's blocks.
    assert len(runner.draft_kv_pool) == 1
    assert runner.draft_kv_pool[0][0].shape == runner.kv_cache_pool[0][0].shape

    own = model_runner(spec_engines["eagle3-full-vocab"]).proposer.model
    assert own.embed_tokens is not None and not bool(own.d2t.any())

    eagle = model_runner(spec_engines["eagle"])
    assert eagle.proposer.target_states.layers == ()  # the target's normed output
    assert eagle.model.model.hidden_tap is None
    assert eagle.proposer.model.fc.bias is not None
    assert eagle.proposer.model.embed_tokens is None  # vLLM serves EAGLE on the target's


def test_eagle3_reads_vllms_default_layers(tmp_path):
    """Without layer ids in its config, an EAGLE-3 head reads layers 2, L // 2 and L - 3."""
    target_dir = make_tiny_model("LlamaForCausalLM", tmp_path / "target", num_hidden_layers=8)
    head = write_eagle3_head(tmp_path / "head", AutoConfig.from_pretrained(target_dir))
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    runner = model_runner(engine(target_dir, config))
    assert runner.proposer.target_states.layers == (2, 4, 5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle3", "num_speculative_tokens": 2}, "head's directory"),
        (
            {"method": "eagle", "model": "x", "num_speculative_tokens": 2, "quantization": "int8"},
            "quantization applies",
        ),
        (
            {
                "method": "eagle3",
                "model": "x",
                "num_speculative_tokens": 2,
                "draft_tensor_parallel_size": 2,
            },
            "must be 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "applies to methods with a draft",
        ),
    ],
)
def test_head_configs_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_what_does_not_fit_the_target_is_refused(tiny_llama, tiny_model_factory, tmp_path):
    target = AutoConfig.from_pretrained(tiny_llama)
    # Default layers of a 2-layer target: (2, 1, -1).
    head = write_eagle3_head(tmp_path / "defaults", target)
    with pytest.raises(ValueError, match="reads target layers"):
        engine(tiny_llama, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    other = AutoConfig.from_pretrained(tiny_model_factory("Qwen2ForCausalLM"))
    other.vocab_size = 1000
    head = write_eagle_head(tmp_path / "vocab", other)
    with pytest.raises(ValueError, match="vocab_size 1000"):
        engine(tiny_llama, {"method": "eagle", "model": str(head), "num_speculative_tokens": 2})


D2T_SPOILED = {
    "a target id past the vocabulary": (torch.tensor([0, 1, 6]), "outside"),
    "a negative target id": (torch.tensor([0, -2, 0]), "outside"),
    "one offset short": (torch.tensor([0, 1]), "shape"),
    "float offsets": (torch.tensor([0.0, 1.0, 1.0]), "integer"),
}


@pytest.mark.parametrize("case", D2T_SPOILED)
def test_a_d2t_that_maps_outside_the_target_vocabulary_is_refused(case):
    """3 draft tokens among 8 target tokens: draft id 2 + 5 = 7 is the last target id (kept);
    + 6 would fail a step, and 1 - 2 would index from the end and mislabel a draft."""
    d2t, message = D2T_SPOILED[case]
    with pytest.raises(ValueError, match=f"'heads/x'.*{message}"):
        checked_d2t(d2t, 3, 8, "heads/x")
    assert torch.equal(
        checked_d2t(torch.tensor([0, 1, 5], dtype=torch.int32), 3, 8, "x"), torch.tensor([0, 1, 5])
    )


def test_a_head_file_whose_d2t_leaves_the_vocabulary_is_refused_at_start_up(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    target = AutoConfig.from_pretrained(tiny_llama)
    head = write_eagle3_head(tmp_path / "head", target, draft_vocab_size=200, aux_layers=AUX_LAYERS)
    tensors = load_file(head / "model.safetensors")
    tensors["d2t"][-1] = target.vocab_size  # the last draft token past the target's last
    save_file(tensors, head / "model.safetensors")
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=re.escape(repr(str(head)))):
        engine(tiny_llama, config)


# ---- exactness --------------------------------------------------------------------------


# Prompts prefilled in chunks, drafts clipped by the budget, and a pool too small for every
# request at once (the head's KV shares it): preemption.
CHUNKED_PREEMPTED = {
    "max_num_batched_tokens": 16,
    "max_model_len": 96,
    "kv_cache_memory": 14 * 8192,
}


@pytest.mark.parametrize(
    ("head", "layout"),
    [
        ("eagle3", {}),
        ("eagle3-full-vocab", {}),
        ("eagle", {}),
        # Under chunking and preemption, one case per way the target's states reach the
        # head: tapped layers (EAGLE-3; its vocabulary does not meet the scheduler, so the
        # full-vocabulary head has no case of its own here) and the normed output (EAGLE).
        ("eagle3", CHUNKED_PREEMPTED),
        pytest.param("eagle", CHUNKED_PREEMPTED, marks=pytest.mark.slow),  # ~12 s
    ],
    ids=lambda value: (
        value if isinstance(value, str) else ("chunked-preempted" if value else "plain")
    ),
)
def test_greedy_equals_no_speculation(
    tiny_llama, heads, spec_engines, reference, chunked_reference, report_ties, head, layout
):
    llm = engine(tiny_llama, heads[head], **layout) if layout else spec_engines[head]
    assert llm.reset_prefix_cache()  # every prompt prefilled here, with its target states
    drafts_before = llm.get_stats().spec_decode.num_drafts
    want = chunked_reference if layout else reference
    actual = greedy_with_logprobs(llm, PROMPTS, len(want[0].token_ids))
    ties, _ = compare_to_reference_engine(want, actual, tie_tolerance=1e-4)
    report_ties(ties, len(PROMPTS))
    stats = llm.get_stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_drafts > drafts_before
    if layout:
        assert stats.num_preemptions > 0
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.slow  # ~26 s on two cores under a load of ~10
def test_prefix_hits_parallel_samples_and_seeds(plain, spec_engines):
    """Prompts again (prefix-cache hits: the head has no target states there), n = 3, and a
    seeded request sampling the same tokens whatever else is in the batch."""
    spec = spec_engines["eagle3"]
    assert spec.reset_prefix_cache()  # the first round prefills, the second hits
    hits_before = spec.get_stats().prefix_cache_hits
    drafts_before = spec.get_stats().spec_decode.num_drafts
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    for params in (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),  # cached now
        SamplingParams(temperature=0, max_tokens=8, n=3, ignore_eos=True),
    ):
        assert_same_outputs(plain, spec, prompts, params)
    assert spec.get_stats().prefix_cache_hits > hits_before
    assert_seeded_sample_alone_as_batched(spec, max_tokens=12)
    assert spec.get_stats().spec_decode.num_drafts > drafts_before


def test_structured_output_with_a_head(plain, spec_engines):
    """Drafts the grammar forbids (a digit) are cut, the others verified; greedy output is
    the same as without speculation and matches the pattern."""
    assert_structured_output_as_plain(plain, spec_engines["eagle"])


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """A one-layer target whose attention adds nothing (o_proj zero): each token's logits
    depend on that token alone."""
    from safetensors.torch import load_file, save_file

    directory = make_tiny_model(
        "LlamaForCausalLM", tmp_path_factory.mktemp("bigram"), num_hidden_layers=1
    )
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"].zero_()
    tensors["model.norm.weight"].fill_(1.0)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, tensors


def test_an_eagle_head_that_copies_its_target_accepts_every_draft(bigram_target, tmp_path):
    """An EAGLE head whose fc passes the embedding through and whose layer is the target's
    proposes exactly the target's greedy tokens (the head at position p reads token p + 1),
    chained: every draft is accepted."""
    from eagle_writer import head_config, write_head

    directory, target = bigram_target
    config = AutoConfig.from_pretrained(directory)
    hidden = config.hidden_size
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in target.items()
        if name.startswith("model.layers.0.")
    }
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    head = write_head(tmp_path / "copy", head_config(config), tensors)
    spec_config = {"method": "eagle", "model": str(head), "num_speculative_tokens": 4}
    plain, spec = engine(directory), engine(directory, spec_config)
    want = greedy_with_logprobs(plain, PROMPTS, 24)
    got = greedy_with_logprobs(spec, PROMPTS, 24)
    compare_to_reference_engine(want, got, tie_tolerance=1e-4)
    counts = spec.get_stats().spec_decode
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0


def test_a_head_proposes_for_lora_requests(tiny_llama, heads, tmp_path):
    """The head reads the hidden states of the target with each request's adapter and
    proposes without adapters of its own; the target verifies: tokens as without a head."""
    from lora_utils import make_peft_adapter

    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", seed=7)
    loras = [None, LoRARequest("a", 1, str(adapter))] * 2
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine(tiny_llama, enable_lora=True)
    spec = engine(tiny_llama, heads["eagle3"], enable_lora=True)
    want = plain.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = spec.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert want[0].outputs[0].token_ids != want[1].outputs[0].token_ids  # the adapter counts
    assert spec.get_stats().spec_decode.num_drafts > 0


# Prompts of 3 to 4 steps' tokens under CHUNKED_PREEMPTED (max_num_batched_tokens 16).
LONG_PROMPTS = [list(range(300, 360)), [9, 8, 7, 6, 5] * 11]


def test_the_head_reads_each_steps_states_in_that_step(tiny_llama, heads, plain, report_ties):
    """Long prompts prefilled in chunks, preemption and aborts: the head catches up on each
    chunk as the target runs it, so no target state outlives its step (none held when a
    forward starts), a step holds its own tokens' states at most, and finished or aborted
    requests leave nothing behind; greedy output is as without speculation."""
    llm = engine(tiny_llama, heads["eagle3"], **CHUNKED_PREEMPTED)
    runner = model_runner(llm)
    proposer = runner.proposer
    at_forward: list[int] = []  # states held when a forward ends, before its hand-over
    in_step: list[int] = []  # states held once the step's are handed over
    read_alone: list[int] = []  # positions the head read in steps where nothing sampled
    observe, propose = proposer.observe_target, proposer.propose

    def observe_and_count(*args) -> None:
        observe(*args)
        in_step.append(proposer.step_states.num_held)

    def propose_and_count(request_ids, batch):
        before = sum(proposer._num_computed.values())
        drafts = propose(request_ids, batch)
        if not request_ids:
            read_alone.append(sum(proposer._num_computed.values()) - before)
        return drafts

    proposer.observe_target, proposer.propose = observe_and_count, propose_and_count
    prompts = LONG_PROMPTS + PROMPTS[:3]
    want = greedy_with_logprobs(plain, prompts, CHUNKED_MAX_TOKENS)
    with runner.forward_observer(lambda step: at_forward.append(proposer.step_states.num_held)):
        got = greedy_with_logprobs(llm, prompts, CHUNKED_MAX_TOKENS)
        _abort_mid_generation(llm.llm_engine)
    ties, _ = compare_to_reference_engine(want, got, tie_tolerance=1e-4)
    report_ties(ties, len(prompts))
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0
    assert at_forward and set(at_forward) == {0}
    assert 0 < max(in_step) <= CHUNKED_PREEMPTED["max_num_batched_tokens"]
    assert read_alone and max(read_alone) > 0  # prompt chunks read as they were computed
    # One more request: its step removes the aborted ones; only it is left, finished.
    one = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": PROMPTS[3]}, one, use_tqdm=False)
    assert len(proposer._num_computed) <= 1 and proposer.step_states.num_held == 0


def _abort_mid_generation(engine) -> None:
    """Two long requests, one aborted while its prompt is prefilled, one while decoding."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for index, prompt in enumerate(LONG_PROMPTS):
        engine.add_request(f"aborted-{index}", {"prompt_token_ids": prompt}, params)
    for _ in range(3):  # 115 prompt tokens at 16 a step: both still prefill
        engine.step()
    engine.abort_request(["aborted-0"])
    for _ in range(8):
        engine.step()
    engine.abort_request(["aborted-1"])
    while engine.has_unfinished_requests():
        engine.step()


def test_requests_a_step_too_large_computed_leave_the_head(tiny_llama, heads, plain):
    """With disable_by_batch_size the head runs nothing in a step of a batch that large, so
    W1 pays nothing for it; the requests such a step computed never draft again (their head
    KV would have a gap), even once alone, while a request that comes alone speculates."""
    config = {**heads["eagle3"], "disable_by_batch_size": 2}
    llm = engine(tiny_llama, config, max_num_batched_tokens=16)  # prompts over several steps
    proposer = model_runner(llm).proposer
    forward, propose = proposer.model.forward, proposer.propose
    calls = {"forward": 0, "large steps": 0}

    def counted_forward(*args):
        calls["forward"] += 1
        return forward(*args)

    def propose_and_check(request_ids, batch):
        before = calls["forward"]
        drafts = propose(request_ids, batch)
        if not proposer._speculating:  # the scheduler's count: 2 running or more
            calls["large steps"] += 1
            assert calls["forward"] == before and not drafts
        return drafts

    proposer.model.forward, proposer.propose = counted_forward, propose_and_check
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert calls["large steps"] > 10 and llm.get_stats().spec_decode.num_drafts == 0
    llm.generate(prompts[0], params, use_tqdm=False)
    assert llm.get_stats().spec_decode.num_drafts > 0 and calls["forward"] > 0
    assert not proposer._behind  # the finished requests were forgotten by that request's step
    proposer._behind.add("preempted")
    proposer.truncate("preempted", 0)  # its states are all computed again
    assert not proposer._behind


def test_compile_leaves_steps_eager_for_an_eagle3_head(tiny_llama, heads, plain, pagedllm_log):
    """A compiled step would not hand the tapped layers over: the target stays eager."""
    llm = engine(tiny_llama, heads["eagle3"], compile=True)
    assert model_runner(llm).compiled_decode is None
    assert "steps stay eager" in pagedllm_log.text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = plain.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    got = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


# ---- sampling through a draft vocabulary --------------------------------------------------


def test_draft_vocabulary_proposals_keep_the_target_distribution():
    """An EAGLE-3 head's logits over 5 of the target's 8 tokens (d2t) become -inf elsewhere;
    its sampled drafts, verified by the rejection sampler, emit the target's distribution,
    tokens outside the draft vocabulary included."""
    config = AutoConfig.for_model(
        "llama",
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=8,
        draft_vocab_size=5,
    )
    head = Eagle3Head(config, None, torch.float32, 16, _torch_kernels(), False, True, 8, 3)
    kept = torch.tensor([0, 2, 3, 5, 7])
    head.d2t.copy_(kept - torch.arange(5))
    torch.manual_seed(3)
    head.lm_head.weight.copy_(torch.randn(5, 8))
    logits = head.compute_logits(torch.randn(2, 8))
    assert torch.isinf(logits[:, [1, 4, 6]]).all() and torch.isfinite(logits[:, kept]).all()

    num_trials = 4000
    temps = torch.ones(num_trials)
    steps = [draft_sample(row.repeat(num_trials, 1), temps, {}) for row in logits]
    drafts = torch.stack([ids for ids, _ in steps], dim=1)
    assert bool(torch.isin(drafts, kept).all())
    q = torch.stack([probs for _, probs in steps], dim=1)
    out = rejection_sample(
        TARGET_ROWS.repeat(num_trials, 1),
        drafts.tolist(),
        list(q),
        uniform_metadata(num_trials, 1.0),
    )
    p = target_probs(TARGET_ROWS, torch.ones(3)).double()
    assert_frequencies_match(torch.tensor([tokens[0] for tokens in out]), p[0])
    second = torch.tensor([tokens[1] for tokens in out if len(tokens) >= 2])
    assert_frequencies_match(second, p[1])


def _torch_kernels():
    from pagedllm.ops.kernel_selection import TORCH_KERNELS

    return TORCH_KERNELS


# ---- the hidden states handed over ----------------------------------------------------------


def test_tap_keeps_the_stream_entering_each_layer(tiny_llama, plain):
    """Layer i's tapped state is the residual stream entering it; index num_layers is the
    last layer's output before the final norm (Transformers' hidden_states agree)."""
    from transformers import AutoModelForCausalLM

    model = model_runner(plain).model
    tap = HiddenStateTap((2, 0, 1))
    tokens = [5, 6, 7, 8, 9]
    captured = []
    assert plain.reset_prefix_cache()  # the whole prompt computed, every row tapped
    model.model.hidden_tap = tap
    try:
        with model_runner(plain).forward_observer(lambda step: captured.append(tap.take())):
            one = SamplingParams(max_tokens=1)
            plain.generate({"prompt_token_ids": tokens}, one, use_tqdm=False)
    finally:
        model.model.hidden_tap = None  # the shared engine goes back untapped
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    # Transformers' last entry is after the final norm; the one before, the stream.
    hidden = states[0].shape[-1]
    got = captured[0]
    for slot, layer in enumerate((0, 1)):
        want = states[layer][0]
        assert torch.allclose(got[:, slot * hidden : (slot + 1) * hidden], want, atol=1e-4)
    pre_norm = got[:, 2 * hidden :]
    normed = hf.model.norm(pre_norm)
    assert torch.allclose(normed, states[2][0], atol=1e-4)


class _Channel:
    """A pipeline group's send and receive between two stages, in one process."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def send(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor)

    def recv(self, shape, dtype) -> torch.Tensor:
        tensor = self.sent.pop(0)
        assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype
        return tensor


def test_stage_taps_carry_the_layers_to_the_last_stage_in_order():
    """Layers (2, 0, 3) of a 3-layer target over stages [0, 2) and [2, 3): the first keeps
    layer 0, the last layers 2 and 3 (the output) and receives the first's column; the last
    stage's columns are in layer order, as one stage keeps them."""
    hidden, tokens = 4, 3
    first = StageTap((2, 0, 3), range(0, 2), 3, False, hidden)
    last = StageTap((2, 0, 3), range(2, 3), 3, True, hidden)
    assert first.tap.layers == (0,) and last.tap.layers == (2, 3)
    assert (first.num_carried_in, last.num_carried_in) == (0, 1)
    stream = {i: torch.full((tokens, hidden), float(i)) for i in range(4)}
    channel = _Channel()
    first.tap.keep(stream[0], None)
    first.send(channel)
    last.receive(channel, tokens, torch.float32)
    last.tap.keep(stream[2], None)
    last.tap.keep(stream[3], None)
    columns = last.take()
    assert columns.shape == (tokens, 3 * hidden) and not channel.sent
    assert columns[0, ::hidden].tolist() == [0.0, 2.0, 3.0]
    one_stage = StageTap((2, 0, 3), range(0, 3), 3, True, hidden)
    assert one_stage.tap.layers == (0, 2, 3) and one_stage.num_carried_in == 0


def test_step_states_are_read_once():
    """A step's states by request and position; taking them leaves nothing held."""
    states = StepStates()
    rows = torch.arange(10.0)[:, None]
    states.observe(["a", "b"], np.array([0, 7]), np.array([6, 4]), rows)
    assert states.num_held == 10
    held, where = states.take()
    assert held is rows  # the forward's own tensor, not a copy
    assert (where["b"].row_of(7), where["b"].row_of(10), where["b"].end) == (6, 9, 11)
    assert where["b"].row_of(11) is None and where["a"].row_of(-1) is None
    assert states.num_held == 0 and states.take() == (None, {})
