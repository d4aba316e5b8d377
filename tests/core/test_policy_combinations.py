"""Every policy schedules every feature through the one loop (`core/policy.py`), with a fake
runner and tiny pools: under "fair" one tenant is scheduled exactly as under "fcfs" with LoRA
slots, speculative drafts, KV-tier swaps and two pipeline batches in flight; with several
tenants each feature's own rule still holds (at most `max_loras` adapters a step, no request
in two batches in flight and none in flight preempted, drafts charged to their tenant) and
every request finishes with every block back in the pool."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig

LORAS = [None, *(LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3))]
FEATURES = ["lora", "spec", "pipeline", "n"]


@dataclass
class Setup:
    feature: str
    policy: str
    num_blocks: int = 24
    budget: int = 24
    max_num_seqs: int = 6

    def scheduler(self) -> Scheduler:
        config = SchedulerConfig(
            self.budget,
            self.max_num_seqs,
            256,
            self.policy,
            fair_quantum=6,
            max_loras=1 if self.feature == "lora" else None,
            max_batches_in_flight=2 if self.feature == "pipeline" else 1,
        )
        spec = SpeculativeConfig("ngram", 3) if self.feature == "spec" else None
        kv = KVCacheManager(self.num_blocks, 4, True)
        return Scheduler(config, kv, speculative_config=spec)


def workload(feature: str, tenants: list[str | None], seed: int = 0) -> dict[int, list]:
    """Requests by the step they arrive in: (id, tenant, prompt, max_tokens, adapter, n)."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    for index in range(24):
        lora = LORAS[index % len(LORAS)] if feature == "lora" else None
        n = rng.choice([1, 2, 3]) if feature == "n" else 1
        prompt = [rng.randrange(10, 90) for _ in range(rng.randint(1, 30))]
        request = (f"r{index}", rng.choice(tenants), prompt, rng.randint(1, 12), lora, n)
        arrivals.setdefault(rng.choice([0, 0, 2, 5, 9]), []).append(request)
    return arrivals


def runner_output(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """Token 7 for each request due one (and each sample it forked); under speculation the
    first of its drafts accepted, and three drafts proposed next."""
    sampled, drafts = {}, {}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests.get(request_id)
        if request is None or request.num_computed_tokens < request.num_tokens:
            continue
        verified = output.scheduled_spec_decode_tokens.get(request_id, [])
        sampled[request_id] = [*verified[:1], 7]
        drafts[request_id] = [7, 8, 9]
        for child_id in output.forked_samples.get(request_id, ()):
            sampled[child_id] = [7]
    return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=drafts)


def drive(setup: Setup, arrivals: dict[int, list], check=None) -> list:
    """Run the workload to the end (two batches in flight under "pipeline"); per step the
    scheduled tokens in order, the drafts and the new requests' block tables."""
    scheduler = setup.scheduler()
    in_flight: list[SchedulerOutput] = []
    trace = []
    for index in range(2000):
        for request_id, tenant, prompt, max_tokens, lora, n in arrivals.get(index, ()):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
            scheduler.add_request(
                Request(request_id, prompt, params, tenant=tenant, lora_request=lora)
            )
        if not scheduler.has_unfinished_requests() and index > max(arrivals):
            break
        output = scheduler.schedule()
        if check is not None:
            check(scheduler, output, in_flight)
        trace.append(
            (
                list(output.num_scheduled_tokens.items()),
                dict(output.scheduled_spec_decode_tokens),
                [(new.request_id, new.block_ids) for new in output.scheduled_new_reqs],
            )
        )
        if output.num_scheduled_tokens:
            in_flight.append(output)
        full = len(in_flight) == scheduler.config.max_batches_in_flight
        if in_flight and (full or not output.num_scheduled_tokens):
            oldest = in_flight.pop(0)
            scheduler.update_from_output(oldest, runner_output(scheduler, oldest))
        scheduler.kv_cache_manager.check_integrity()
    else:
        raise AssertionError("the workload did not finish")
    kv = scheduler.kv_cache_manager
    assert not in_flight and not scheduler.requests
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
    return [trace, scheduler.num_preemptions]


@pytest.mark.parametrize("feature", FEATURES)
def test_one_tenant_under_fair_is_scheduled_exactly_as_fcfs(feature):
    arrivals = workload(feature, ["only"])
    fcfs = drive(Setup(feature, "fcfs"), arrivals)
    fair = drive(Setup(feature, "fair"), arrivals)
    assert fcfs[1] > 0  # the pool is small enough to preempt
    assert fair == fcfs
    if feature == "spec":
        assert any(drafts for _, drafts, _ in fair[0])


def check_feature_rules(feature: str):
    def check(scheduler: Scheduler, output: SchedulerOutput, in_flight: list) -> None:
        scheduled = output.num_scheduled_tokens
        assert sum(scheduled.values()) <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        if feature == "lora":
            adapters = {scheduler.requests[r].lora_int_id for r in scheduled} - {0}
            assert len(adapters) <= 1
        if feature == "pipeline":
            busy = {r for batch in in_flight for r in batch.num_scheduled_tokens}
            assert busy.isdisjoint(scheduled)
            for request_id in busy:  # still running, with its blocks
                assert scheduler.requests[request_id].status == RequestStatus.RUNNING

    return check


@pytest.mark.parametrize("feature", FEATURES)
def test_tenants_share_under_each_feature_with_its_rules_kept(feature):
    arrivals = workload(feature, ["a", "b", "c"], seed=3)
    _, num_preemptions = drive(Setup(feature, "fair"), arrivals, check_feature_rules(feature))
    assert num_preemptions > 0


def test_drafts_are_charged_to_their_tenant():
    scheduler = Setup("spec", "fair", budget=64).scheduler()
    fair = scheduler.policy.fair_share
    charged: list[tuple[str, int]] = []
    charge = fair.charge
    fair.charge = lambda tenant, num_tokens: (
        charged.append((tenant, num_tokens)),
        charge(tenant, num_tokens),
    )
    for request_id, tenant in (("a", "A"), ("b", "B")):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        scheduler.add_request(Request(request_id, [11, 12, 13], params, tenant=tenant))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner_output(scheduler, output))
    assert charged == [("A", 3), ("B", 3)]
    output = scheduler.schedule()
    # Each verifies three drafts: four tokens each, charged to its own tenant.
    assert output.num_scheduled_tokens == {"a": 4, "b": 4}
    assert output.scheduled_spec_decode_tokens == {"a": [7, 8, 9], "b": [7, 8, 9]}
    assert charged[2:] == [("A", 4), ("B", 4)]
