"""Speculative decoding in the scheduler, with a fake runner and tiny block pools: drafts are
scheduled inside the token budget and their slots allocated like any other; rejected ones are
rolled back in the same step (computed tokens and exact block ids); stops inside an accepted
run are exact; drafts never reach past max_tokens or the context."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig

NGRAM = SpeculativeConfig("ngram", 3)
DRAFT = SpeculativeConfig("draft_model", 3, model="draft")


def make(num_blocks=9, block_size=4, budget=32, max_model_len=64, spec=NGRAM, caching=True):
    config = SchedulerConfig(budget, 8, max_model_len)
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(config, kv, speculative_config=spec)


def add(scheduler, request_id, prompt, max_tokens=20, **params):
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))
    scheduler.add_request(request)
    return request


def run(scheduler, output, tokens, drafts=None):
    """The runner's answer: `tokens[request id]` emitted, `drafts` proposed next."""
    result = ModelRunnerOutput(sampled_token_ids=tokens, draft_token_ids=drafts or {})
    outputs = scheduler.update_from_output(output, result)
    scheduler.kv_cache_manager.check_integrity()
    return {o.request_id: o for o in outputs}


def test_drafts_are_scheduled_verified_and_rejected_slots_returned():
    scheduler = make()
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "a", range(10, 16))  # 6 tokens: blocks 1, 2
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 6}
    run(scheduler, output, {"a": [50]}, {"a": [51, 52, 53]})
    assert request.spec_token_ids == [51, 52, 53]
    # The last token and three drafts: positions 6..9, a third block.
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert output.scheduled_cached_reqs[0].new_block_ids == [3]
    assert request.num_computed_tokens == 10
    # One draft accepted, then a correction: 8 tokens computed, 9 known.
    outputs = run(scheduler, output, {"a": [51, 60]}, {"a": [61, 62, 63]})
    assert outputs["a"].new_token_ids == [51, 60]
    assert request.output_token_ids == [50, 51, 60]
    assert request.num_computed_tokens == 8
    # Block 3 held only rejected drafts' KV (positions 8 and 9): back in the pool.
    assert kv.get_block_ids("a") == [1, 2]
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks - 2
    # Only verified tokens' blocks reach the prefix cache: block 1 (block 2 was not full of
    # verified tokens when the step began) ...
    assert kv.block_pool.num_cached_blocks == 1
    output = scheduler.schedule()
    assert kv.block_pool.num_cached_blocks == 2  # ... and block 2 once it is
    cached = output.scheduled_cached_reqs[0]
    # The table changed in place: sent whole, but the request was not preempted.
    assert cached.resumed_from_preemption and not cached.preempted
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_decode_tokens == {"a": [61, 62, 63]}


def test_drafts_share_the_token_budget():
    scheduler = make(budget=6)
    add(scheduler, "a", range(10, 14))
    output = scheduler.schedule()
    run(scheduler, output, {"a": [50]}, {"a": [51, 52, 53]})
    add(scheduler, "b", range(20, 24))
    output = scheduler.schedule()
    # a first (running): its token and three drafts; b gets the two tokens left.
    assert output.num_scheduled_tokens == {"a": 4, "b": 2}
    run(scheduler, output, {"a": [51]}, {"a": [61, 62, 63]})
    scheduler_b = make(budget=3)
    add(scheduler_b, "a", range(10, 13))
    output = scheduler_b.schedule()
    run(scheduler_b, output, {"a": [50]}, {"a": [51, 52, 53]})
    output = scheduler_b.schedule()
    # A budget of three: the last token and the first two drafts.
    assert output.scheduled_spec_decode_tokens == {"a": [51, 52]}


def test_stops_inside_an_accepted_run_are_exact():
    scheduler = make()
    request = add(scheduler, "a", range(10, 14), max_tokens=3)
    output = scheduler.schedule()
    run(scheduler, output, {"a": [50]}, {"a": [51, 52, 53]})
    # max_tokens=3: one token out, so only one draft is worth verifying (its bonus is #3).
    assert request.spec_token_ids == [51]
    output = scheduler.schedule()
    outputs = run(scheduler, output, {"a": [51, 52]})
    assert outputs["a"].new_token_ids == [51, 52]
    assert outputs["a"].finish_reason == "length"
    scheduler = make()
    add(scheduler, "b", range(10, 14), stop_token_ids=[52])
    output = scheduler.schedule()
    run(scheduler, output, {"b": [50]}, {"b": [51, 52, 53]})
    output = scheduler.schedule()
    outputs = run(scheduler, output, {"b": [51, 52, 53, 54]})
    # The stop token lands inside the run: the tokens after it are dropped.
    assert outputs["b"].new_token_ids == [51, 52]
    assert outputs["b"].finish_reason == "stop" and outputs["b"].stop_reason == 52
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_drafts_stop_at_the_context():
    scheduler = make(max_model_len=12)
    request = add(scheduler, "a", range(10, 20), max_tokens=None)
    output = scheduler.schedule()
    run(scheduler, output, {"a": [50]}, {"a": [51, 52, 53]})
    assert request.spec_token_ids == [51]  # 11 tokens: one more position, then the end


def test_draft_model_holds_lookahead_slots():
    """A draft model writes its next proposals' KV past the verified tokens: the scheduler
    holds num_speculative_tokens slots more, and keeps them when cutting back."""
    scheduler = make(spec=DRAFT)
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "a", range(10, 16))
    output = scheduler.schedule()
    # 6 tokens + 3 lookahead slots: three blocks.
    assert output.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    run(scheduler, output, {"a": [50]}, {"a": [51, 52, 53]})
    output = scheduler.schedule()
    # Positions 6..9 and 3 lookahead: up to 12, a fourth block.
    assert output.scheduled_cached_reqs[0].new_block_ids == [4]
    run(scheduler, output, {"a": [60]})  # every draft rejected
    assert request.num_computed_tokens == 7
    assert kv.get_block_ids("a") == [1, 2, 3]  # 7 computed + 3 lookahead: three blocks


def test_preempted_request_drops_its_drafts():
    scheduler = make(num_blocks=6)  # five usable blocks of four tokens
    a = add(scheduler, "a", range(10, 17), max_tokens=8)
    b = add(scheduler, "b", range(20, 27), max_tokens=8)
    output = scheduler.schedule()  # two blocks each
    run(scheduler, output, {"a": [50], "b": [60]}, {"a": [51, 52, 53], "b": [61, 62, 63]})
    output = scheduler.schedule()
    # a's token and drafts take the last free block; b's find none: b (the newest) yields.
    assert scheduler.num_preemptions == 1
    assert output.num_scheduled_tokens == {"a": 4}
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    run(scheduler, output, {"a": [51, 52, 53, 54]}, {"a": [55]})
    assert a.num_computed_tokens == 11
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        tokens = {
            r: [9]
            for r in output.num_scheduled_tokens
            if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
        }
        run(scheduler, output, tokens)
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_disable_by_batch_size():
    spec = SpeculativeConfig("ngram", 3, disable_by_batch_size=2)
    scheduler = make(spec=spec)
    add(scheduler, "a", range(10, 14))
    add(scheduler, "b", range(20, 24))
    output = scheduler.schedule()
    run(scheduler, output, {"a": [50], "b": [60]}, {"a": [51], "b": [61]})
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {}
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
