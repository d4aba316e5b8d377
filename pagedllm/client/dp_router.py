"""Data-parallel routing: which of N engine cores runs a request, and what each core holds.

With `data_parallel_size` N > 1 the front end (the server's `AsyncLLM`, the offline
`LLMEngine`) runs N engine cores, each with its own scheduler and KV cache. `DPRouter` picks
one per request and keeps, per core, what the front end knows of it:

- its load: the engine requests (each of a request's n samples counts) sent to it and not
  finished or aborted yet;
- a bounded LRU of the prompt block hashes sent to it: the prefixes its prefix cache most
  likely still holds. The hashes are the core's own (`core/hashing.py`, salt included), so
  a request matches a core in whole KV blocks exactly as the core's prefix cache would.

Policy `prefix` (the default): among the cores not clearly busier than the least loaded one
(load more than `load_threshold` above it), the one holding the longest run of the prompt's
leading blocks; with no block held anywhere, the least loaded. Policy `round_robin` (for
comparisons): the cores in turn. Ties go to the next core in turn after the last one chosen,
so an idle engine spreads requests instead of piling them on core 0.

Pure Python, no I/O. Both data-parallel front ends (the offline `DPInprocClient`, the server's
`AsyncLLM`) keep their routing here: `route_request` picks and records a request's core,
`finish_outputs` and `finish_all` release what the cores finished or are told to abort (the
latter grouped by core, to send each core its own aborts), `forget_engine` and
`forget_blocks` drop what a replaced or reset core held.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedllm.core import hashing
from pagedllm.core.request import child_request_id

if TYPE_CHECKING:
    from pagedllm.core.messages import EngineCoreOutput, EngineCoreRequest

ROUTING_POLICIES = ("prefix", "round_robin")
# Internal switch for comparisons (tests, benchmarks): PAGEDLLM_DP_ROUTING=round_robin.
ROUTING_ENV = "PAGEDLLM_DP_ROUTING"
# A core is clearly busier when it runs this many more requests than the least loaded one:
# then a prefix hit there would cost more in queueing than it saves in prefill.
DEFAULT_LOAD_THRESHOLD = 8


def routing_policy_from_env() -> str:
    policy = os.environ.get(ROUTING_ENV, "prefix") or "prefix"
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"{ROUTING_ENV} must be one of {list(ROUTING_POLICIES)}, got {policy!r}")
    return policy


def prompt_block_hashes(
    prompt_token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[hashing.BlockHash]:
    """The chained hashes of the prompt's full blocks, as the core's prefix cache makes them."""
    block_hashes: list[hashing.BlockHash] = []
    hashing.extend_block_hashes(block_hashes, prompt_token_ids, block_size, cache_salt)
    return block_hashes


class DPRouter:
    def __init__(
        self,
        num_engines: int,
        max_blocks_per_engine: int,
        policy: str = "prefix",
        load_threshold: int = DEFAULT_LOAD_THRESHOLD,
    ) -> None:
        if num_engines < 1 or max_blocks_per_engine < 1 or load_threshold < 0:
            raise ValueError(
                "num_engines and max_blocks_per_engine must be positive, load_threshold >= 0"
            )
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {list(ROUTING_POLICIES)}")
        self.num_engines = num_engines
        self.policy = policy
        self.load_threshold = load_threshold
        self.max_blocks_per_engine = max_blocks_per_engine
        self.loads = [0] * num_engines
        # Per core: block hash -> None, oldest first (an LRU bounded by the core's pool).
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self._engine_of: dict[str, int] = {}  # engine request id (samples too) -> core
        self._next = 0  # the next core in turn (round robin, and ties)

    # ---- choosing -------------------------------------------------------------------------
    def matched_blocks(self, engine: int, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the core was sent before (the hashes are
        chained, so the first one it lacks ends the run)."""
        held = self._blocks[engine]
        count = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def choose(self, block_hashes: Sequence[int], exclude: Iterable[int] = ()) -> int:
        """The core for a request with these prompt block hashes (changes nothing).
        `exclude`: cores that cannot take requests now (restarting); all excluded: ValueError."""
        excluded = set(exclude)
        order = [
            (self._next + step) % self.num_engines
            for step in range(self.num_engines)
            if (self._next + step) % self.num_engines not in excluded
        ]
        if not order:
            raise ValueError("no engine core can take requests")
        if self.policy == "round_robin":
            return order[0]
        least = min(self.loads[engine] for engine in order)
        candidates = [e for e in order if self.loads[e] - least <= self.load_threshold]
        matches = {engine: self.matched_blocks(engine, block_hashes) for engine in candidates}
        best = max(matches.values())
        if best > 0:  # the longest held prefix, then the lighter load, then the turn
            return min((e for e in candidates if matches[e] == best), key=lambda e: self.loads[e])
        return min(order, key=lambda engine: self.loads[engine])  # min keeps the turn order

    # ---- bookkeeping ----------------------------------------------------------------------
    def route(
        self,
        request_id: str,
        num_samples: int,
        block_hashes: Sequence[int],
        exclude: Iterable[int] = (),
    ) -> int:
        """Choose the core for a request and record it there (its n samples, its blocks)."""
        engine = self.choose(block_hashes, exclude)
        self.assign(engine, request_id, num_samples, block_hashes)
        return engine

    def route_request(
        self, request: EngineCoreRequest, block_size: int, exclude: Iterable[int] = ()
    ) -> int:
        """`route` for an engine request: its n samples, its prompt's blocks of `block_size`
        tokens (hashed with its cache salt, as the core's prefix cache hashes them)."""
        block_hashes = prompt_block_hashes(request.prompt_token_ids, block_size, request.cache_salt)
        return self.route(request.request_id, request.sampling_params.n, block_hashes, exclude)

    def assign(
        self, engine: int, request_id: str, num_samples: int, block_hashes: Sequence[int]
    ) -> None:
        for index in range(num_samples):
            self._engine_of[child_request_id(request_id, index)] = engine
        self.loads[engine] += num_samples
        held = self._blocks[engine]
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.max_blocks_per_engine:
            held.popitem(last=False)
        self._next = (engine + 1) % self.num_engines

    def engine_of(self, request_id: str) -> int | None:
        """The core running this engine request (a sample's id too), None once finished."""
        return self._engine_of.get(request_id)

    def finish(self, request_id: str) -> int | None:
        """The engine request finished or was aborted: its core's load drops. Returns the
        core, or None if it had finished already (aborting a finished request is harmless)."""
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self.loads[engine] -= 1
        return engine

    def finish_all(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """`finish` each engine request; those that were running, by their core (in order)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.finish(request_id)
            if engine is not None:  # None: the core finished it already
                by_engine.setdefault(engine, []).append(request_id)
        return by_engine

    def finish_outputs(self, outputs: Iterable[EngineCoreOutput]) -> None:
        """`finish` the engine requests that these outputs of the cores finish."""
        for output in outputs:
            if output.finished:
                self.finish(output.request_id)

    def forget_engine(self, engine: int) -> list[str]:
        """The core was replaced (its requests failed, its cache is empty) or its prefix cache
        reset: drop what it held. Returns the engine request ids it was running."""
        lost = [rid for rid, owner in self._engine_of.items() if owner == engine]
        for request_id in lost:
            del self._engine_of[request_id]
        self.loads[engine] = 0
        self._blocks[engine].clear()
        return lost

    def forget_blocks(self, engine: int) -> None:
        """The core's prefix cache was reset: its requests still run, its prefixes are gone."""
        self._blocks[engine].clear()
