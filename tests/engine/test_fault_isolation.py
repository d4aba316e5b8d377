"""Fault isolation in the engine core: an exception that belongs to one request (its logits
processors, its grammar, its parallel-sample fork, its detokenization) fails that request
alone. It finishes with finish_reason "error" and a message, its KV blocks come back, every
other request in the batch produces exactly the tokens it produces without the fault, and
the engine keeps serving. An error no single request reproduces still ends the engine."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.runner.input_batch import InputBatch
from pagedllm.runner.sampling_stage import SamplingStage
from pagedllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager

# Lengths 5..21 over 8-token blocks: full and partial blocks, prompts of different lengths.
PROMPTS = [
    {"prompt_token_ids": [(13 * i + 7 * j) % 500 + 3 for j in range(5 + 4 * i)]} for i in range(5)
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAULTY = 2  # the request that fails, in the middle of the batch
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=128, block_size=8)


@pytest.fixture(scope="module")
def baseline(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run(llm, params: list[SamplingParams], tweak=None) -> list:
    """Queue PROMPTS with `params` (tweak(index, request) may replace a request, bypassing
    the checks at the edge as a bug would), step the engine until all finish, and return the
    final outputs in order (all n samples of each, as LLM.generate does)."""
    engine = llm.llm_engine
    request_ids = []
    for index, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        text, request = engine.process_inputs(f"fi-{next(_ids)}-{index}", prompt, p)
        if tweak is not None:
            request = tweak(index, request)
        engine.add_processed_request(text, request)
        request_ids.append(request.request_id)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return [finals[request_id] for request_id in request_ids]


def assert_healthy(llm, baseline) -> None:
    """Every block is back, and the engine still produces the same tokens."""
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert not core.has_unfinished_requests()
    assert llm.get_stats().num_used_blocks == 0
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == baseline


def assert_others_unaffected(outputs, baseline) -> None:
    for index, output in enumerate(outputs):
        if index != FAULTY:
            assert output.outputs[0].finish_reason == "length"
            assert output.outputs[0].token_ids == baseline[index]
            assert output.error is None


def test_logits_processor_fault_fails_only_its_request(llm, baseline):
    # The crash: min_tokens with a stop token id past the vocabulary (IndexError in
    # the bans). The edge refuses it now, so the request is altered after the checks.
    vocab_size = llm.llm_engine.model_config.vocab_size

    def tweak(index, request):
        if index != FAULTY:
            return request
        params = dataclasses.replace(
            request.sampling_params, min_tokens=3, stop_token_ids=[vocab_size + 7]
        )
        return msgspec.structs.replace(request, sampling_params=params)

    outputs = run(llm, [GREEDY] * len(PROMPTS), tweak)
    failed = outputs[FAULTY].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "IndexError" in failed.error and outputs[FAULTY].error == failed.error
    assert outputs[FAULTY].finished
    assert_others_unaffected(outputs, baseline)
    assert_healthy(llm, baseline)


def test_logits_processor_fault_mid_generation_with_seeded_neighbours(llm, monkeypatch):
    """A fault after some tokens; the other rows are seeded samples, which draw from their own
    generators and so must be untouched when a row drops out of the batch."""
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=50 + i, max_tokens=10, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
    engine = llm.llm_engine
    original = SamplingStage._apply_logits_processors
    bad_id = f"fi-seeded-{FAULTY}"
    # The fault hits once the request has 4 output tokens.
    fault_at = 4 + len(PROMPTS[FAULTY]["prompt_token_ids"])

    def faulty(self, logits, rows):
        bad_row = self.input_batch.req_id_to_row.get(bad_id)
        if bad_row in rows.tolist() and self.input_batch.num_tokens[bad_row] >= fault_at:
            raise RuntimeError("boom in a logits processor")
        return original(self, logits, rows)

    monkeypatch.setattr(SamplingStage, "_apply_logits_processors", faulty)
    request_ids = []
    for index, (prompt, params) in enumerate(zip(PROMPTS, seeded, strict=True)):
        request_ids.append(f"fi-seeded-{index}")
        engine.add_request(request_ids[-1], prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    outputs = [finals[request_id].outputs[0] for request_id in request_ids]
    assert outputs[FAULTY].finish_reason == "error"
    assert "boom in a logits processor" in outputs[FAULTY].error
    assert outputs[FAULTY].token_ids == alone[FAULTY][:4]  # what it had before the fault
    for index, output in enumerate(outputs):
        if index != FAULTY:
            assert output.token_ids == alone[index]
    monkeypatch.undo()
    llm.llm_engine.engine_core.check_integrity()
    assert llm.get_stats().num_used_blocks == 0


def test_grammar_accept_fault_fails_only_its_request(llm, baseline, monkeypatch):
    choice = StructuredOutputsParams(choice=["yes please", "no thanks", "maybe later"])
    constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice)
    params = [GREEDY] * len(PROMPTS)
    params[FAULTY] = constrained
    params[4] = constrained  # a healthy constrained neighbour
    clean = run(llm, params)
    assert clean[4].outputs[0].finish_reason == "stop" and clean[FAULTY].error is None

    original = StructuredOutputManager.accept

    def accept(self, request, token_id):
        if request.request_id.endswith(f"-{FAULTY}") and request.num_output_tokens >= 2:
            raise ValueError("boom in grammar accept")
        return original(self, request, token_id)

    monkeypatch.setattr(StructuredOutputManager, "accept", accept)
    outputs = run(llm, params)
    failed = outputs[FAULTY].outputs[0]
    assert failed.finish_reason == "error" and "boom in grammar accept" in failed.error
    assert outputs[4].outputs[0].token_ids == clean[4].outputs[0].token_ids
    assert outputs[4].outputs[0].finish_reason == "stop"
    for index in (0, 1, 3):
        assert outputs[index].outputs[0].token_ids == baseline[index]
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_grammar_bitmask_fault_fails_only_its_request(llm, baseline, monkeypatch):
    choice = StructuredOutputsParams(choice=["yes please", "no thanks"])
    params = [GREEDY] * len(PROMPTS)
    params[FAULTY] = SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice)
    original = StructuredOutputManager.bitmask

    def bitmask(self, requests, drafts=None):
        if any(r.request_id.endswith(f"-{FAULTY}") and r.num_output_tokens for r in requests):
            raise ValueError("boom in the grammar bitmask")
        return original(self, requests, drafts)

    monkeypatch.setattr(StructuredOutputManager, "bitmask", bitmask)
    outputs = run(llm, params)
    failed = outputs[FAULTY].outputs[0]
    assert failed.finish_reason == "error" and "boom in the grammar bitmask" in failed.error
    assert len(failed.token_ids) == 1  # its first token was constrained; the second failed
    assert_others_unaffected(outputs, baseline)
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_detokenization_fault_fails_only_its_request(llm, baseline):
    engine = llm.llm_engine
    processed = [
        engine.process_inputs(f"fi-detok-{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)
    ]
    for text, request in processed:
        engine.add_processed_request(text, request)
    detokenizer = engine.output_processor.states[f"fi-detok-{FAULTY}"].detokenizer
    original, calls = detokenizer.update, []

    def update(token_ids):
        calls.append(token_ids)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "boom in detokenization")
        return original(token_ids)

    detokenizer.update = update
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    outputs = [finals[f"fi-detok-{i}"] for i in range(len(PROMPTS))]
    failed = outputs[FAULTY].outputs[0]
    assert failed.finish_reason == "error" and "detokenization failed" in failed.error
    assert failed.token_ids == baseline[FAULTY][:3]
    assert_others_unaffected(outputs, baseline)
    assert_healthy(llm, baseline)  # the core let go of it (aborted) and freed its blocks


def test_forked_sample_fault_fails_only_that_sample(llm, baseline, monkeypatch):
    sampled = SamplingParams(temperature=1.0, seed=77, n=3, max_tokens=10, ignore_eos=True)
    params = [GREEDY] * len(PROMPTS)
    params[FAULTY] = sampled
    clean = run(llm, params)
    original = InputBatch.add_request

    def add_request(self, request_id, token_ids, params, *args, **kwargs):
        if request_id.endswith(f"-{FAULTY}#1") and params.seed is not None:
            raise OverflowError("boom forking a sample: its generator refuses the seed")
        return original(self, request_id, token_ids, params, *args, **kwargs)

    monkeypatch.setattr(InputBatch, "add_request", add_request)
    outputs = run(llm, params)
    samples = outputs[FAULTY].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    assert samples[1].finish_reason == "error" and "boom forking a sample" in samples[1].error
    assert samples[1].token_ids == []
    for index in (0, 2):  # the seeded siblings draw exactly what they drew without the fault
        assert samples[index].token_ids == clean[FAULTY].outputs[index].token_ids
        assert samples[index].finish_reason == "length"
    assert_others_unaffected(outputs, baseline)
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_a_fault_in_every_row_fails_each_request_not_the_engine(llm, baseline):
    vocab_size = llm.llm_engine.model_config.vocab_size

    def tweak(index, request):
        params = dataclasses.replace(
            request.sampling_params, min_tokens=2, stop_token_ids=[vocab_size + index]
        )
        return msgspec.structs.replace(request, sampling_params=params)

    outputs = run(llm, [GREEDY] * len(PROMPTS), tweak)
    assert all(o.outputs[0].finish_reason == "error" for o in outputs)
    assert_healthy(llm, baseline)


def test_an_error_no_request_reproduces_still_ends_the_step(tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8)
    original = SamplingStage._per_request_stages

    def only_batched(self, logits, rows, req_ids):
        if len(req_ids) > 1:
            raise RuntimeError("engine bug, not any request's")
        return original(self, logits, rows, req_ids)

    monkeypatch.setattr(SamplingStage, "_per_request_stages", only_batched)
    with pytest.raises(RuntimeError, match="engine bug"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
