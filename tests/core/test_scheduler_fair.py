"""The "fair" scheduling policy with a fake runner and tiny pools: deficit round-robin turns,
weights, claims of seats and blocks by dominant share, fairness preemption, and that with one
tenant it schedules exactly as fcfs does."""

import random

import pytest
from test_scheduler import EOS, assert_all_blocks_free, step

from pagedllm.config import EngineArgs, SchedulerConfig, parse_tenant_weights
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import FairQueue
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams


def make_scheduler(
    num_blocks=65,
    block_size=4,
    budget=32,
    max_num_seqs=8,
    policy="fair",
    weights=(),
    quantum=None,
    caching=False,
):
    config = SchedulerConfig(budget, max_num_seqs, 512, policy, weights, quantum)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


def add(scheduler, request_id, tenant, num_prompt_tokens, max_tokens=4, prompt=None):
    request = Request(
        request_id,
        prompt or [1] * num_prompt_tokens,
        SamplingParams(max_tokens=max_tokens),
        frozenset({EOS}),
        tenant=tenant,
    )
    scheduler.add_request(request)
    return request


def scheduled(output):
    return list(output.num_scheduled_tokens.items())


def run_to_completion(scheduler, max_steps=2000):
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        steps += 1
        assert steps < max_steps
    assert_all_blocks_free(scheduler)
    scheduler.schedule()  # an idle step: tenants without requests leave the ring
    assert scheduler.policy.fair_share.ring == []
    return steps


# ---- the waiting queue ---------------------------------------------------------------------
def test_fair_queue_keeps_each_tenant_in_arrival_order():
    queue = FairQueue()
    assert isinstance(queue, FairQueue)
    params = SamplingParams(max_tokens=1)
    a1, a2, b1, c1 = (
        Request(name, [1], params, tenant=name[0]) for name in ("a1", "a2", "b1", "c1")
    )
    a0 = Request("a0", [1], params, tenant="a")
    for request in (a1, b1, a2, c1):
        queue.add(request)
    queue.add_preempted(a0)  # back at its tenant's head
    assert len(queue) == 5
    assert queue.tenants() == ["a", "b", "c"]
    assert list(queue.tenant_queue("a")) == [a0, a1, a2]
    assert list(queue) == [a0, b1, c1, a1, a2]  # tenants in turn
    queue.remove(b1)
    assert queue.tenants() == ["a", "c"]
    assert queue.pop_tenant("c") is c1
    assert [queue.pop() for _ in range(3)] == [a0, a1, a2]
    assert len(queue) == 0 and list(queue) == []


# ---- configuration -------------------------------------------------------------------------
def test_tenant_weights_are_parsed_and_checked():
    assert parse_tenant_weights("gold=4, free=0.5") == {"gold": 4.0, "free": 0.5}
    assert parse_tenant_weights({"x": 2}) == {"x": 2.0}
    assert parse_tenant_weights(None) == {}
    for bad in ("gold", "gold=x", "=2", "a=0", "a=-1", "a=nan", "a=inf", {"a": True}):
        with pytest.raises(ValueError, match="tenant_weights"):
            parse_tenant_weights(bad)
    config = SchedulerConfig(64, 4, 128, "fair", {"b": 2, "a": 1})
    assert config.tenant_weights == (("a", 1.0), ("b", 2.0))
    assert config.fair_quantum == 8  # an eighth of the budget
    hash(config)  # stays hashable
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(64, 4, 128, "lottery")
    with pytest.raises(ValueError, match="fair_quantum"):
        SchedulerConfig(64, 4, 128, "fair", (), 0)
    args = EngineArgs(scheduling_policy="fair", tenant_weights="gold=4")  # the CLI's form
    assert args.tenant_weights == {"gold": 4.0}
    with pytest.raises(ValueError, match="tenant_weights apply to scheduling_policy='fair'"):
        EngineArgs(tenant_weights={"gold": 4})


# ---- one tenant: exactly fcfs --------------------------------------------------------------
def trace(scheduler, requests_by_step, steps=400):
    """Per step: scheduled tokens in order, new requests' block tables, running ones' new
    blocks and whether they resumed."""
    result = []
    for index in range(steps):
        for args in requests_by_step.get(index, ()):
            add(scheduler, *args)
        if not scheduler.has_unfinished_requests():
            break
        output = step(scheduler)
        result.append(
            (
                scheduled(output),
                [
                    (r.request_id, r.block_ids, r.num_computed_tokens)
                    for r in output.scheduled_new_reqs
                ],
                [
                    (r.request_id, r.new_block_ids, r.resumed_from_preemption)
                    for r in output.scheduled_cached_reqs
                ],
            )
        )
    return result, scheduler.num_preemptions


@pytest.mark.parametrize("tenant", [None, "only"])
def test_one_tenant_is_scheduled_exactly_as_fcfs(tenant):
    rng = random.Random(1)
    requests_by_step = {}
    for i in range(40):
        arrival = rng.choice([0, 0, 0, 3, 10, 25])
        requests_by_step.setdefault(arrival, []).append(
            (str(i), tenant, rng.randint(1, 50), rng.randint(1, 14))
        )
    fcfs = trace(
        make_scheduler(num_blocks=30, budget=24, max_num_seqs=5, policy="fcfs"), requests_by_step
    )
    fair = trace(make_scheduler(num_blocks=30, budget=24, max_num_seqs=5), requests_by_step)
    assert fcfs[1] > 0  # the pool is small enough to preempt
    assert fair == fcfs


# ---- deficit round-robin -------------------------------------------------------------------
def test_tenants_take_turns_of_one_quantum():
    # Quantum 2 tokens: each turn admits one 2-token prompt of its tenant.
    scheduler = make_scheduler(budget=12, max_num_seqs=16, quantum=2)
    for i in range(4):
        add(scheduler, f"a{i}", "A", 2, max_tokens=3)
    for i in range(4):
        add(scheduler, f"b{i}", "B", 2, max_tokens=3)
    first = step(scheduler)
    assert scheduled(first) == [("a0", 2), ("b0", 2), ("a1", 2), ("b1", 2), ("a2", 2), ("b2", 2)]
    # The budget ran out in B's turn, which goes on in this step with its deficit spent, so
    # it ends at once; then turns of two tokens each: A's decodes, B's, then one decode and
    # half of a3's prompt for A (not enough: its turn ends, keeping 1), likewise for B, and
    # A's and B's next turns cover a3 and b3.
    second = step(scheduler)
    assert scheduled(second) == [
        ("a0", 1),
        ("a1", 1),
        ("b0", 1),
        ("b1", 1),
        ("a2", 1),
        ("b2", 1),
        ("a3", 2),
        ("b3", 2),
    ]
    assert scheduler.num_preemptions == 0
    run_to_completion(scheduler)


def test_weights_split_the_budget():
    # One-token prompts that finish at their first token: every step admits 8 new ones,
    # gold (weight 3) three for each of free's (weight 1).
    scheduler = make_scheduler(budget=8, max_num_seqs=8, weights={"gold": 3}, quantum=1)
    for i in range(60):
        add(scheduler, f"g{i}", "gold", 1, max_tokens=1)
        add(scheduler, f"f{i}", "free", 1, max_tokens=1)
    for _ in range(5):
        output = step(scheduler)
        tenants = [request_id[0] for request_id in output.num_scheduled_tokens]
        assert tenants.count("g") == 6 and tenants.count("f") == 2
    # A tenant alone gets the whole budget.
    scheduler = make_scheduler(budget=8, max_num_seqs=8, weights={"gold": 3}, quantum=1)
    for i in range(20):
        add(scheduler, f"f{i}", "free", 1, max_tokens=1)
    assert len(step(scheduler).num_scheduled_tokens) == 8


def test_deficit_is_kept_for_an_unaffordable_request_and_forfeited_when_idle():
    scheduler = make_scheduler(budget=6, max_num_seqs=8, quantum=4)
    fair = scheduler.policy.fair_share
    add(scheduler, "a0", "A", 10, max_tokens=1)
    b0 = add(scheduler, "b0", "B", 3, max_tokens=1)
    add(scheduler, "b1", "B", 3, max_tokens=1)
    # A's turn: 4 do not cover a0's 6 (the budget); B's: b0, then 1 left does not cover b1.
    # A's next turn: 8 cover what is left of the budget (3) and the step ends in its turn.
    assert scheduled(step(scheduler)) == [("b0", 3), ("a0", 3)]
    assert fair.deficits == {"A": 5, "B": 1}
    # A's turn goes on: 5 do not cover 6; B's: b1, and B has nothing left to run, so it
    # forfeits the rest; A's next turn: 9 cover 3.
    assert scheduled(step(scheduler)) == [("b1", 3), ("a0", 3)]
    assert fair.deficits == {"A": 6, "B": 0}
    assert b0.is_finished
    step(scheduler)
    assert fair.ring == ["A"]  # B has no requests: it left the ring, and its deficit with it
    run_to_completion(scheduler)


# ---- a flooding tenant cannot starve another ------------------------------------------------
def test_flooding_tenant_cannot_starve_another():
    scheduler = make_scheduler(budget=16, max_num_seqs=4)
    flood = [add(scheduler, f"a{i}", "A", 4, max_tokens=30) for i in range(50)]
    for _ in range(3):
        step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a0", "a1", "a2", "a3"]
    b = add(scheduler, "b0", "B", 4, max_tokens=3)
    output = step(scheduler)
    # B holds no seat and A all four: A's newest gives B its seat, and B runs at once.
    assert flood[3].status == RequestStatus.PREEMPTED
    assert scheduler.waiting.tenant_queue("A")[0] is flood[3]  # back at A's head
    assert scheduled(output) == [("a0", 1), ("a1", 1), ("a2", 1), ("b0", 4)]
    assert b.num_output_tokens == 1
    # B keeps its seat until it finishes, then A resumes a3 (recomputed) before a4.
    step(scheduler)
    output = step(scheduler)
    assert b.is_finished and "b0" in output.num_scheduled_tokens
    output = step(scheduler)
    assert output.scheduled_cached_reqs[-1].request_id == "a3"
    assert output.scheduled_cached_reqs[-1].resumed_from_preemption
    assert scheduler.num_preemptions == 1
    run_to_completion(scheduler, max_steps=5000)


def flood(policy):
    scheduler = make_scheduler(budget=16, max_num_seqs=4, policy=policy)
    for i in range(50):
        add(scheduler, f"a{i}", "A", 6, max_tokens=40)
    for _ in range(4):
        step(scheduler)
    return scheduler


def test_under_fcfs_the_flood_starves_the_other_tenant():
    scheduler = flood("fcfs")
    b = add(scheduler, "b0", "B", 5, max_tokens=2)
    for _ in range(100):
        step(scheduler)
    assert b.status == RequestStatus.WAITING


def test_each_new_request_of_the_starved_tenant_is_admitted_within_a_step():
    # B sends one request at a time while A has 50 waiting and every seat.
    scheduler = flood("fair")
    for i in range(5):
        b = add(scheduler, f"b{i}", "B", 5, max_tokens=2)
        steps = 0
        while not b.num_output_tokens:
            step(scheduler)
            steps += 1
        assert steps == 1
        while not b.is_finished:
            step(scheduler)
        assert len(scheduler.waiting.tenant_queue("A")) >= 40
    run_to_completion(scheduler, max_steps=5000)


def test_seats_are_split_by_weight_and_never_taken_back_and_forth():
    scheduler = make_scheduler(num_blocks=129, budget=64, max_num_seqs=8, weights={"B": 3})
    for i in range(30):
        add(scheduler, f"a{i}", "A", 4, max_tokens=50)
    for _ in range(2):
        step(scheduler)
    assert len(scheduler.running) == 8
    for i in range(30):
        add(scheduler, f"b{i}", "B", 4, max_tokens=50)
    step(scheduler)
    # B's weight is 3 of 4: six seats; A keeps two.
    by_tenant = [r.tenant for r in scheduler.running]
    assert by_tenant.count("B") == 6 and by_tenant.count("A") == 2
    assert scheduler.num_preemptions == 6
    for _ in range(40):
        step(scheduler)
    assert scheduler.num_preemptions == 6


def test_odd_seats_settle_without_preemptions():
    scheduler = make_scheduler(budget=64, max_num_seqs=5)
    for i in range(20):
        add(scheduler, f"a{i}", "A", 4, max_tokens=40)
        add(scheduler, f"b{i}", "B", 4, max_tokens=40)
    step(scheduler)
    by_tenant = [r.tenant for r in scheduler.running]
    assert sorted(by_tenant) == ["A", "A", "A", "B", "B"]
    for _ in range(60):
        step(scheduler)
    assert scheduler.num_preemptions == 0
    run_to_completion(scheduler, max_steps=5000)


# ---- KV blocks -----------------------------------------------------------------------------
def test_fairness_preemption_returns_the_blocks_to_the_pool():
    # 8 usable blocks of 4 tokens; A's two 15-token prompts fill them.
    scheduler = make_scheduler(num_blocks=9, block_size=4, budget=64)
    kv = scheduler.kv_cache_manager
    a0 = add(scheduler, "a0", "A", 15, max_tokens=6)
    a1 = add(scheduler, "a1", "A", 15, max_tokens=6)
    output = step(scheduler)
    assert [r.block_ids for r in output.scheduled_new_reqs] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert kv.num_free_blocks == 0
    add(scheduler, "b0", "B", 3, max_tokens=2)
    output = step(scheduler)
    # A holds the whole pool; its newest request is preempted and B gets a block of it
    # (freed tail first, so its last block comes first).
    assert a1.status == RequestStatus.PREEMPTED and a1.num_computed_tokens == 0
    assert scheduled(output) == [("a0", 1), ("b0", 3)]
    assert [(r.request_id, r.block_ids) for r in output.scheduled_new_reqs] == [("b0", [8])]
    assert kv.get_block_ids("a1") == []
    assert kv.num_free_blocks == 3  # a1's other three (it needs four to come back)
    kv.check_integrity()
    run_to_completion(scheduler)
    assert a0.num_output_tokens == a1.num_output_tokens == 6


def test_a_short_pool_preempts_the_tenant_above_its_share_not_the_newest_request():
    def run(policy):
        # 7 usable blocks of 4 tokens.
        scheduler = make_scheduler(num_blocks=8, block_size=4, budget=64, policy=policy)
        add(scheduler, "a0", "A", 7, max_tokens=10)
        add(scheduler, "a1", "A", 7, max_tokens=10)
        step(scheduler)
        add(scheduler, "b0", "B", 7, max_tokens=10)
        step(scheduler)  # a0, a1 and b0 hold two blocks each
        # Each needs a third block now; one is free: a0 takes it, and a1 finds none.
        step(scheduler)
        return {r.request_id for r in scheduler.running}

    assert run("fcfs") == {"a0", "a1"}  # the newest request (b0) is preempted
    assert run("fair") == {"a0", "b0"}  # A holds five blocks, B two: A's newest goes


def test_n_greater_than_one_samples_stay_with_their_tenant():
    scheduler = make_scheduler(budget=32, max_num_seqs=8)
    add(scheduler, "a0", "A", 4, max_tokens=1)
    params = SamplingParams(max_tokens=1, n=3)
    scheduler.add_request(Request("b0", [1] * 4, params, frozenset({EOS}), tenant="B"))
    output = scheduler.schedule()
    assert output.forked_samples == {"b0": ["b0#1", "b0#2"]}
    assert {r.request_id: r.tenant for r in scheduler.running} == {
        "a0": "A",
        "b0": "B",
        "b0#1": "B",
        "b0#2": "B",
    }
    sampled = {key: [7] for key in ["a0", "b0", "b0#1", "b0#2"]}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_abort_under_fair_frees_blocks_from_any_state():
    scheduler = make_scheduler(num_blocks=9, block_size=4, budget=16, max_num_seqs=2)
    for i in range(3):
        add(scheduler, f"a{i}", "A", 6, max_tokens=20)
    add(scheduler, "b0", "B", 6, max_tokens=20)
    step(scheduler)
    for request_id in ("a0", "a2", "b0", "a1"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        scheduler.kv_cache_manager.check_integrity()
    assert not scheduler.has_unfinished_requests()
    step(scheduler)  # the ring forgets both tenants
    assert scheduler.policy.fair_share.ring == []
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("caching", [False, True])
def test_random_tenants_never_exceed_the_limits_and_all_finish(caching):
    rng = random.Random(7)
    scheduler = make_scheduler(
        num_blocks=33,
        block_size=4,
        budget=24,
        max_num_seqs=5,
        weights={"t1": 2, "t2": 0.5},
        caching=caching,
    )
    # With caching, prompts share prefixes (within and across tenants) and hit the cache.
    prefixes = [[rng.randrange(2, 90) for _ in range(12)] for _ in range(3)]
    requests = []
    for index in range(300):
        if index < 60 and rng.random() < 0.6:
            tenant = rng.choice([None, "t1", "t2", "t3"])
            prompt = rng.choice(prefixes)[: rng.randint(1, 12)]
            prompt += [rng.randrange(2, 90) for _ in range(rng.randint(1, 28))]
            requests.append(add(scheduler, str(index), tenant, 0, rng.randint(1, 10), prompt))
        if not scheduler.has_unfinished_requests():
            continue
        output = step(scheduler)
        assert 0 < output.total_num_scheduled_tokens <= 24
        assert len(scheduler.running) <= 5
    run_to_completion(scheduler, max_steps=5000)
    for request in requests:
        assert request.num_output_tokens == request.sampling_params.max_tokens
    assert scheduler.num_preemptions > 0
    if caching:
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
