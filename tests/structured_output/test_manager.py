"""Structured output in the scheduler, with a scripted fake grammar and no model: a request
waits while its grammar compiles without holding others back, a failed grammar ends its
request, bitmasks cover exactly the constrained rows that sample, and a completed grammar
finishes its request."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sample.grammar_bitmask import apply_bitmask, apply_bitmask_torch
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarMatcher, StructuredOutputBackend
from pagedllm.structured_output.manager import StructuredOutputManager

VOCAB = 40
EOS = 39


class ScriptedMatcher(GrammarMatcher):
    """Allows exactly `script[i]` at step i; terminated after the last."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.position = script, 0

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or token_id != self.script[self.position]:
            return False
        self.position += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        token = self.script[self.position]
        bitmask[row] = 0
        bitmask[row, token // 32] = 1 << (token % 32)

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens

    def is_terminated(self) -> bool:
        return self.position == len(self.script)


class FakeBackend(StructuredOutputBackend):
    name = "fake"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_compiles = 0

    def compile(self, spec: StructuredOutputsParams):
        self.num_compiles += 1
        self.release.wait(10)
        if spec.regex == "bad":
            raise ValueError("invalid regex: bad")
        return [int(c) for c in spec.choice[0].split(",")]

    def matcher(self, compiled) -> ScriptedMatcher:
        return ScriptedMatcher(list(compiled))

    def validate(self, spec) -> None:
        pass


def make(budget=64):
    manager = StructuredOutputManager(object(), VOCAB, [EOS])
    manager._backend = FakeBackend()
    config = SchedulerConfig(budget, 8, 128, "fcfs")
    return Scheduler(config, KVCacheManager(33, 4, False), manager), manager._backend


def add(scheduler, request_id, spec=None, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec)
    request = Request(request_id, [1, 2, 3, 4, 5], params, frozenset({EOS}))
    scheduler.add_request(request)
    return request


def run(scheduler, output, choose):
    """Sample, for every row due a token, choose(request_id, allowed token ids)."""
    sampled = {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens < request.num_tokens:
            continue
        logits = torch.zeros(1, VOCAB)
        row = output.grammar_rows.get(request_id)
        if row is not None:
            apply_bitmask(logits, output.grammar_bitmask[[row]], torch.tensor([0]))
        allowed = torch.nonzero(logits[0] > float("-inf")).flatten().tolist()
        sampled[request_id] = [choose(request_id, allowed)]
    return scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))


def choice(tokens: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=[tokens])


def test_compiling_request_waits_without_blocking_others():
    scheduler, backend = make()
    add(scheduler, "constrained", choice("7,8,EOS".replace("EOS", str(EOS))))
    add(scheduler, "free")
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["free"]  # the grammar is still compiling
    assert first.grammar_bitmask is None
    run(scheduler, first, lambda rid, allowed: 3)
    backend.release.set()
    deadline = time.monotonic() + 10
    while "constrained" not in (output := scheduler.schedule()).num_scheduled_tokens:
        run(scheduler, output, lambda rid, allowed: 3)
        assert time.monotonic() < deadline
    assert output.grammar_rows == {"constrained": 0}  # "free" decodes unconstrained
    assert output.grammar_bitmask.shape == (1, (VOCAB + 31) // 32)


def test_bitmask_drives_tokens_and_completed_grammar_finishes():
    scheduler, backend = make()
    backend.release.set()
    request = add(scheduler, "r", choice("5,6,7"), max_tokens=20)
    finished = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        outputs = run(scheduler, output, lambda rid, allowed: allowed[0])
        finished += [o for o in outputs if o.finished]
        if not output.num_scheduled_tokens:
            time.sleep(0.001)
    assert request.output_token_ids == [5, 6, 7]
    assert finished[0].finish_reason == "stop"
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_failed_grammar_ends_its_request_with_an_error():
    scheduler, backend = make()
    backend.release.set()
    add(scheduler, "bad", StructuredOutputsParams(regex="bad"))
    outputs = []
    deadline = time.monotonic() + 10
    while scheduler.has_unfinished_requests():
        outputs += run(scheduler, scheduler.schedule(), lambda rid, allowed: 3)
        assert time.monotonic() < deadline
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [
        ("bad", True, "error")
    ]
    assert "invalid regex: bad" in outputs[0].error


def test_grammars_compile_once_per_spec():
    scheduler, backend = make()
    backend.release.set()
    requests = [add(scheduler, f"r{i}", choice("5,6")) for i in range(3)]
    requests.append(add(scheduler, "other", choice("6,5")))
    for request in requests:
        request.structured_output.future.result(10)
    assert backend.num_compiles == 2


@pytest.mark.parametrize("apply", [apply_bitmask, apply_bitmask_torch])
def test_apply_bitmask_forbids_exactly_the_cleared_bits(apply):
    logits = torch.zeros(3, 70)
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    bitmask[0, 1] = 0  # tokens 32..63 forbidden in mask row 0
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 5  # only token 69 allowed in mask row 1
    apply(logits, bitmask, torch.tensor([2, 0]))
    assert torch.isinf(logits[2, 32:64]).all() and torch.isfinite(logits[2, :32]).all()
    assert torch.isfinite(logits[2, 64:]).all()
    assert torch.isfinite(logits[1]).all()  # unconstrained row untouched
    assert torch.nonzero(torch.isfinite(logits[0])).flatten().tolist() == [69]
