"""benchmarks.train_eagle's pieces on a tiny random target: the states captured during
generation are the target's (as a prefill computes them), the written head loads through
the engine and greedy output equals no speculation, the draft vocabulary's maps agree, and
the training module drafts exactly what the engine's head drafts from the same weights (so
that what training optimizes is what the engine serves)."""

from __future__ import annotations

import time

import pytest
import torch
from model_utils import model_runner
from safetensors.torch import load_file

from benchmarks.eagle_train.acceptance import Replay, replay, replayed_acceptance
from benchmarks.eagle_train.capture import generate_with_states
from benchmarks.eagle_train.export import read_head_dir
from benchmarks.eagle_train.head_model import TrainableEagle3Head, ttt_mask
from benchmarks.eagle_train.loop import TrainSettings
from benchmarks.eagle_train.vocab import most_frequent
from benchmarks.train_eagle import TargetParts, distil, new_head
from pagedllm import LLM, SamplingParams

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11] * 3,
    list(range(100, 130)),
    [3, 200, 7, 90, 45, 300, 12, 8],
    [70, 71, 72, 73, 74, 75] * 4,
    list(range(250, 262)),
    [40, 41, 42, 43] * 6,
]
LAYERS = (0, 1, 2)  # the tiny target has 2 layers
DRAFT_VOCAB = 96
NUM_SPECULATIVE = 3


def engine(model, speculative_config=None) -> LLM:
    return LLM(
        str(model),
        speculative_config=speculative_config,
        max_model_len=256,
        kv_cache_memory="8MiB",
        enable_prefix_caching=False,  # every position's states computed
    )


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """(the plain engine, its captured sequences, the head's directory, the report)."""
    llm = engine(tiny_llama)
    sequences = generate_with_states(llm, token_prompts(PROMPTS), LAYERS, 24, torch.float32)
    settings = TrainSettings(steps=3, lr=1e-3, ttt_steps=3, bf16=False, seed=0, warmup=1)
    out = tmp_path_factory.mktemp("eagle3-trained")
    deadline = time.monotonic() + 600
    report = distil(sequences, TargetParts(llm), LAYERS, out, settings, DRAFT_VOCAB, 256, deadline)
    return llm, sequences, out, report


def test_captured_states_are_a_prefills(trained):
    """States filed per request over batched decode steps equal one prefill of the whole
    sequence: no request's rows were filed under another's."""
    llm, sequences, _, _ = trained
    for sequence in sequences[:3]:
        assert sequence.states.shape == (len(sequence.token_ids) - 1, 3 * 64)
        (again,) = generate_with_states(
            llm, token_prompts([sequence.token_ids]), LAYERS, 1, torch.float32
        )
        torch.testing.assert_close(
            again.states[: len(sequence.states)], sequence.states, atol=1e-4, rtol=1e-4
        )


def test_written_head_loads_and_greedy_equals_no_speculation(tiny_llama, trained):
    llm, _, out, report = trained
    assert report["steps_run"] == 3
    config = {"method": "eagle3", "model": str(out), "num_speculative_tokens": NUM_SPECULATIVE}
    spec = engine(tiny_llama, config)
    head = model_runner(spec).proposer.model
    assert head.draft_vocab_size == DRAFT_VOCAB
    assert torch.equal(head.d2t, load_file(out / "model.safetensors")["d2t"].long())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    got = spec.generate(token_prompts(PROMPTS), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.get_stats().spec_decode.num_drafts > 0


def test_draft_vocabulary_maps_agree(trained):
    _, sequences, out, _ = trained
    tensors = load_file(out / "model.safetensors")
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"]
    target_ids = torch.arange(DRAFT_VOCAB) + d2t
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and int(target_ids[-1]) < 512
    assert t2d.dtype == torch.bool and int(t2d.sum()) == DRAFT_VOCAB
    assert bool(t2d[target_ids].all())
    # Every token the generations used is in it (they use fewer than DRAFT_VOCAB).
    generated = {t for s in sequences for t in s.token_ids[s.prompt_len :]}
    assert len(generated) < DRAFT_VOCAB and generated <= set(target_ids.tolist())


def test_most_frequent_fills_and_maps_back():
    vocab = most_frequent([[7, 7, 7, 3, 3, 9]], 5, 20)
    assert vocab.target_ids.tolist() == [0, 1, 3, 7, 9]  # seen first, then the lowest unseen
    table = vocab.draft_ids()
    assert table[vocab.target_ids].tolist() == list(range(5))
    assert int((table >= 0).sum()) == 5 and int(table[2]) == -100
    assert most_frequent([[7, 7, 3, 3, 3, 9]], 2, 20).target_ids.tolist() == [3, 7]


def test_ttt_mask_is_what_chained_drafts_see():
    assert torch.equal(ttt_mask(4, 0), torch.ones(4, 4, dtype=torch.bool).tril())
    mask = ttt_mask(5, 2)  # step 2 at p: step 0's keys up to p - 2, step 1's at p - 1, its own
    row = 4
    assert mask[row, :5].tolist() == [True, True, True, False, False]
    assert mask[row, 5:10].tolist() == [False, False, False, True, False]
    assert mask[row, 10:].tolist() == [False, False, False, False, True]


def _torch_drafts(head: TrainableEagle3Head, token_ids, states, target_ids, k) -> list[int]:
    """The head's greedy chain from the last verified position, as the engine drafts."""
    drafts: list[int] = []
    base = len(token_ids) - 2  # the last position with a target state
    for step in range(k):
        tokens = torch.tensor(token_ids[1:] + drafts)[None]
        padded = torch.zeros(1, tokens.shape[1], states.shape[1])
        padded[0, : base + 1] = states[: base + 1]
        with torch.no_grad():
            normed = head(tokens, padded, step + 1)[step][0, base + step]
            drafts.append(int(target_ids[int(head.lm_head(normed).argmax())]))
    return drafts


def test_training_module_drafts_as_the_engine_head(tiny_llama, trained, tmp_path):
    """The engine's proposals (recorded from its proposer) equal the training module's on
    the same weights and the same target states."""
    llm, _, out, _ = trained
    config = {"method": "eagle3", "model": str(out), "num_speculative_tokens": NUM_SPECULATIVE}
    spec = engine(tiny_llama, config)
    proposer = model_runner(spec).proposer
    original = proposer.propose
    proposals: list[tuple[list[int], list[int]]] = []

    def record(request_ids, batch):
        drafts = original(request_ids, batch)
        for request_id, tokens in drafts.items():
            row = batch.row(request_id)
            seen = batch.token_ids[row, : int(batch.num_tokens[row])].tolist()
            proposals.append((seen, list(tokens)))
        return drafts

    proposer.propose = record
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec.generate(token_prompts(PROMPTS[:3]), params, use_tqdm=False)
    assert len(proposals) > 3

    target = TargetParts(llm)
    tensors = load_file(out / "model.safetensors")
    target_ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"].long()
    head = new_head(target, LAYERS, most_frequent([target_ids.tolist()], DRAFT_VOCAB, 512), 0)
    own = head.published_tensors()
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(tensors[_published_name(name)])
    assert own.keys() <= tensors.keys()
    for seen, drafts in proposals:
        (full,) = generate_with_states(llm, token_prompts([seen]), LAYERS, 1, torch.float32)
        got = _torch_drafts(head, seen, full.states, target_ids, NUM_SPECULATIVE)
        assert got == drafts, f"after {len(seen)} tokens"


def _published_name(name: str) -> str:
    layer = {
        "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj",
        "v_proj": "self_attn.v_proj",
        "o_proj": "self_attn.o_proj",
        "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj",
        "down_proj": "mlp.down_proj",
    }
    module, _, kind = name.partition(".")
    if module in ("fc", "norm", "lm_head"):
        return name
    return f"midlayer.{layer.get(module, module)}.{kind}"


def test_replay_walks_verification_steps():
    """Prompt of 3 tokens, 9 positions (12 tokens): drafts from position 2 (after the
    prefill's token); each step advances by the accepted drafts plus the target's token."""
    right = torch.zeros(3, 9, dtype=torch.bool)
    right[0, 2] = right[1, 3] = True  # from 2: two accepted, step 2 at 4 wrong
    right[0, 5] = True  # from 5: one accepted (step 1 at 6 wrong)
    right[1, 8] = True  # from 7: none (step 0 wrong: later steps never count); from 8: none
    out = Replay()
    replay(right, 3, 3, out)
    assert (out.num_drafts, out.num_accepted) == (4, 3)
    assert out.mean_acceptance_length == 1.75
    everything = Replay()
    replay(torch.ones(2, 9, dtype=torch.bool), 3, 2, everything)
    # From 2 and 5 both drafts; from 8 one (the sequence ends after position 8's label).
    assert (everything.num_drafts, everything.num_accepted) == (3, 5)


def test_replayed_acceptance_is_the_engines(tiny_llama, trained):
    """Replaying the head over the target's own greedy sequences gives exactly the
    engine's acceptance with that head on the same prompts."""
    llm, sequences, out, _ = trained
    config = {"method": "eagle3", "model": str(out), "num_speculative_tokens": NUM_SPECULATIVE}
    spec = engine(tiny_llama, config)
    params = SamplingParams(temperature=0, max_tokens=24)  # as the capture generated
    for sequence in sequences:  # one at a time: the engine's verifying steps are its own
        spec.generate(token_prompts([sequence.token_ids[: sequence.prompt_len]]), params)
    counts = spec.get_stats().spec_decode

    head, vocab, layers = read_head_dir(out, TargetParts(llm).embedding)
    assert layers == LAYERS
    draft_ids = vocab.draft_ids()
    replayed = replayed_acceptance(head, sequences, draft_ids, NUM_SPECULATIVE, 24)
    assert replayed.num_accepted > 0
    assert (replayed.num_drafts, replayed.num_accepted) == (
        counts.num_drafts,
        counts.num_accepted_tokens,
    )


def test_read_head_dir_gives_back_what_was_written(trained):
    llm, _, out, _ = trained
    head, vocab, _ = read_head_dir(out, TargetParts(llm).embedding)
    tensors = load_file(out / "model.safetensors")
    for name, tensor in head.published_tensors().items():
        assert torch.equal(tensor, tensors[name]), name
    assert torch.equal(vocab.d2t, tensors["d2t"]) and torch.equal(vocab.t2d, tensors["t2d"])
