"""Edge cases of parallel sampling and streaming: seats for future samples, closing and
cancelling streams, event loops, prompt logprobs in delta streams."""

import asyncio
import threading

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

PROMPT = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(21)]}  # 21: a partial block


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=128, block_size=8)


def test_parallel_sampling_children_respect_max_num_seqs(tiny_llama):
    """A request with n > 1 holds seats for its future samples, so no step ever schedules
    more than max_num_seqs sequences; an n above max_num_seqs is refused up front."""
    llm = LLM(str(tiny_llama), max_model_len=128, block_size=8, max_num_seqs=3)
    engine, scheduler = llm.llm_engine, llm.llm_engine.engine_core.scheduler
    sizes = []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        sizes.append(len(output.num_scheduled_tokens))
        return output

    scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=5, ignore_eos=True)
    for name in ("p", "q"):
        engine.add_request(name, PROMPT, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert max(sizes) <= 3, f"scheduled sequences per step: {sizes} (max_num_seqs=3)"
    assert max(sizes) == 2  # q waited for p's two samples to finish
    with pytest.raises(ValueError, match="n=4 is above max_num_seqs=3"):
        llm.generate(PROMPT, SamplingParams(n=4), use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_closing_a_stream_after_the_parent_finished_aborts_the_children(llm):
    """A consumer that leaves early aborts every sample still running, even once
    completion 0 (the parent) has finished."""
    engine = llm.llm_engine
    probe = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate(PROMPT, probe, use_tqdm=False)
    parent, child = output.outputs[0].token_ids, output.outputs[1].token_ids
    stop = next(t for t in parent[1:] if t not in child)  # ends the parent early, not the child
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        n=2,
        max_tokens=100,
        ignore_eos=True,
        stop_token_ids=[stop],
        output_kind=RequestOutputKind.DELTA,
    )
    left = False
    for out in engine.stream(PROMPT, params, request_id="s"):
        if out.outputs[0].index == 0 and out.outputs[0].finish_reason is not None:
            left = True
            break  # the consumer goes away: the request must be aborted
    assert left
    still_running = list(engine.engine_core.scheduler.requests)
    # Clean up so later tests see an idle engine.
    engine.abort_request(["s"])
    while engine.has_unfinished_requests():
        engine.step()
    assert still_running == [], f"left running after the stream closed: {still_running}"


async def _consume(engine, index):
    prompt = {"prompt_token_ids": [5 + index] * 9}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = []
    async for out in engine.astream(prompt, params):
        tokens = out.outputs[0].token_ids
    return tokens


def test_astream_works_in_a_second_event_loop(llm):
    """The same engine serves concurrent streams from a second `asyncio.run` (a lock bound
    to the first event loop would raise there)."""
    engine = llm.llm_engine

    async def main():
        return await asyncio.gather(*(_consume(engine, i) for i in range(3)))

    first = asyncio.run(main())
    try:
        second = asyncio.run(main())
    finally:
        # Whatever the outcome, leave an idle engine behind.
        for request_id in list(engine.output_processor.states):
            engine.abort_request([request_id])
        while engine.has_unfinished_requests():
            engine.step()
    assert second == first


def test_cancelled_astream_does_not_touch_the_engine_while_a_step_runs(llm):
    """A consumer cancelled while its step runs in a worker thread must not abort its
    request (or let anyone else change the engine) until that step is over."""
    engine = llm.llm_engine
    real_step, real_abort = engine._step, engine.engine_core.abort_requests
    in_step, gate = threading.Event(), threading.Event()
    overlaps = []

    def slow_step():
        in_step.set()
        gate.wait(timeout=3)
        try:
            return real_step()
        finally:
            in_step.clear()

    def recording_abort(request_ids):
        overlaps.append(in_step.is_set())
        return real_abort(request_ids)

    engine._step = slow_step
    engine.engine_core.abort_requests = recording_abort
    try:

        async def main():
            task = asyncio.create_task(_consume(engine, 0))
            while not in_step.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
    finally:
        del engine._step, engine.engine_core.abort_requests
        gate.set()
        while engine.has_unfinished_requests():
            engine.step()
    assert overlaps and not any(overlaps), "abort ran while a step was still in progress"


def test_delta_stream_with_n_sends_prompt_logprobs_once_per_completion(llm):
    """With n > 1, DELTA outputs carry prompt_logprobs once, with the first output (as
    n == 1 does)."""
    params = SamplingParams(
        temperature=1.0,
        seed=4,
        n=2,
        max_tokens=6,
        ignore_eos=True,
        prompt_logprobs=1,
        output_kind=RequestOutputKind.DELTA,
    )
    outputs = list(llm.llm_engine.stream(PROMPT, params))
    with_prompt_logprobs = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(outputs) > 2
    assert len(with_prompt_logprobs) <= 2, (
        f"{len(with_prompt_logprobs)} of {len(outputs)} delta outputs repeat prompt_logprobs"
    )
