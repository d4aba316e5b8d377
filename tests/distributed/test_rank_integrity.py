"""Every rank's KV integrity in debug mode (`PAGEDLLM_DEBUG=1`, set by conftest): each rank
checks, in every step, its KV tensors' shape and its block tables against the scheduler's.
A normal tensor- or pipeline-parallel run passes the check on every rank in every step; a
rank whose table is corrupted, and one rank in one process whose pool or tables are wrong,
make the step raise naming that rank. With debug checks off nothing is checked or sent."""

from __future__ import annotations

import os
import re

import pytest
from model_utils import model_runner

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc_executor import MultiprocExecutor, WorkerError
from pagedllm.runner.kv_integrity import KVIntegrityError
from pagedllm.worker.worker import Worker

PROMPTS = [[7 + i for i in range(n)] for n in (5, 21, 40, 60)]


class CheckedWorker(Worker):
    """A real worker (built in each `mp` worker process) that counts its steps and the KV
    checks it passed, and once armed (`corrupt_after_next_step`) writes wrong block ids into
    its running requests' tables after its next step."""

    def init_device(self) -> None:
        super().init_device()
        self.steps = self.checks_passed = 0
        self.corruption: str | None = None
        runner = self.model_runner
        check = runner.check_kv_integrity

        def counted(expected) -> None:
            check(expected)
            self.checks_passed += 1

        runner.check_kv_integrity = counted

    def execute_model(self, scheduler_output):
        output = super().execute_model(scheduler_output)
        self.steps += 1
        if self.corruption is not None and scheduler_output.num_scheduled_tokens:
            _corrupt(self.model_runner, scheduler_output.kv_check, self.corruption)
            self.corruption = None
        return output

    def counts(self) -> tuple[int, int]:
        return self.steps, self.checks_passed

    def corrupt_after_next_step(self, rank: int, how: str) -> None:
        """`how`: "other" (another block of the pool) or "null" (the null block)."""
        if self.rank == rank:
            self.corruption = how


def _corrupt(runner, expected, how: str) -> None:
    """Overwrite the first block of every running request (one of them at least runs on:
    none is near its end, and the oldest is never the one preempted)."""
    batch = runner.input_batch
    for request_id, blocks in expected.block_tables.items():
        if blocks:
            row = batch.row(request_id)
            first = int(batch.block_table[row, 0])
            batch.block_table[row, 0] = (
                0 if how == "null" else first % (expected.num_blocks - 1) + 1
            )


@pytest.fixture
def checked_workers(monkeypatch):
    # The spawned workers import this module by name: the tests directory is on their path.
    monkeypatch.setattr(MultiprocExecutor, "worker_class", f"{__name__}:CheckedWorker")


def _llm(directory, kv_cache_memory: str, **parallel) -> LLM:
    # Small budgets: prefills run in chunks.
    return LLM(
        str(directory),
        max_model_len=96,
        block_size=8,
        max_num_batched_tokens=24,
        kv_cache_memory=kv_cache_memory,
        **parallel,
    )


def _generate(llm: LLM, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize(
    ("layout", "rank", "how", "problem"),
    [
        ({"tensor_parallel_size": 2}, 1, "other", r"block table \[\d+.*\] != the scheduler's"),
        ({"pipeline_parallel_size": 2}, 0, "null", r"block\(s\) \[0\] are the null block"),
    ],
    ids=["tp2-rank1-other-block", "pp2-rank0-null-block"],
)
def test_every_rank_checks_every_step_and_a_corrupted_one_is_named(
    tiny_llama, checked_workers, layout, rank, how, problem
):
    # 13 blocks of each rank's half of the model (2,048 bytes each): the four requests
    # need 22 at their longest, so some are preempted and resume with a rewritten table.
    llm = _llm(tiny_llama, kv_cache_memory=str(13 * 2048), **layout)
    core = llm.llm_engine.engine_core
    executor = core.model_executor
    pids = executor.worker_pids
    try:
        _generate(llm, max_tokens=10)
        assert core.scheduler.num_preemptions > 0
        counts = executor.collective_rpc("counts")
        steps = counts[0][0]
        assert steps > 4 and counts == [(steps, steps)] * 2  # every rank, every step

        executor.collective_rpc("corrupt_after_next_step", (rank, how))
        with pytest.raises(WorkerError) as raised:
            _generate(llm, max_tokens=20)
    finally:
        core.shutdown()
    message = str(raised.value)
    assert f"worker rank {rank} raised in execute_model: KVIntegrityError" in message
    assert f"KV integrity check failed on rank {rank} (" in message
    assert re.search(problem, message), message
    assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)


# ---- one rank, in this process ----------------------------------------------------------
def _step_until_running(llm: LLM, max_tokens: int = 20) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        llm.llm_engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        llm.llm_engine.step()


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        (lambda pool: pool + 3, r"block\(s\) \[\d+\] are the null block \(0\) or outside"),
        (lambda pool: 0, r"block\(s\) \[0\] are the null block"),
    ],
    ids=["out-of-range", "null"],
)
def test_one_rank_with_a_wrong_block_is_named(tiny_llama, block, problem):
    llm = _llm(tiny_llama, kv_cache_memory="1MiB")
    _step_until_running(llm)
    runner = model_runner(llm)
    num_blocks = runner.kv_caches[0][0].shape[0]
    row = runner.input_batch.row("0")
    runner.input_batch.block_table[row, 0] = block(num_blocks)
    with pytest.raises(KVIntegrityError, match=r"failed on rank 0 \(.*request '0': ") as raised:
        llm.llm_engine.step()
    assert re.search(problem, str(raised.value))


def test_one_rank_with_a_wrong_kv_shape_is_named(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory="1MiB")
    _step_until_running(llm)
    runner = model_runner(llm)
    key, value = runner.kv_caches[1]
    runner.kv_caches[1] = (key[:, :, :1].clone(), value)  # one KV head short
    with pytest.raises(KVIntegrityError, match=r"rank 0 .*layer 1's K cache is \(\d+, 8, 1, 16\)"):
        llm.llm_engine.step()


def test_nothing_is_checked_or_sent_with_debug_checks_off(tiny_llama):
    llm = _llm(tiny_llama, kv_cache_memory="1MiB")
    core = llm.llm_engine.engine_core
    core.debug_checks = False
    runner = model_runner(llm)
    sent, checked = [], []
    execute = core.model_executor.execute_model
    original_check = runner.check_kv_integrity

    def recording_execute(scheduler_output, *args, **kwargs):
        sent.append(scheduler_output.kv_check)
        return execute(scheduler_output, *args, **kwargs)

    core.model_executor.execute_model = recording_execute
    runner.check_kv_integrity = lambda expected: checked.append(original_check(expected))
    _generate(llm, max_tokens=5)
    assert sent and sent == [None] * len(sent)
    assert not checked
