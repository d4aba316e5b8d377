"""The soak's engine kills and process readings: SIGKILL of the engine core every
`kill_every_s`, the time until the server serves again, each core's resident memory at a fixed
age, and which failed requests were the kills' in-flight ones.

A request is the kill's in-flight casualty (`killed_in_flight`) when it failed by the server's
fault (a 5xx, or an error event in a 200 stream) and it was sent no later than
`KILL_NOTICE_S` after a kill and ended after it: sent before the kill, or in the moment before
the server noticed the core was gone and handed the request to the dead core. Any other
failure stays `failed`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from benchmarks.soak_memory import RSS_OUTSIDE_POOL_DEFINITION, core_usage
from benchmarks.soak_traffic import Attempt

# How long after a SIGKILL a request may still be handed to the dead core (the server learns
# of the death from the core's closed socket, within milliseconds; two seconds is generous).
KILL_NOTICE_S = 2.0
MONITOR_EVERY_S = 5.0
# A kill waits at most this long for the server to serve again before the soak goes on.
RECOVERY_TIMEOUT_S = 300.0


def killed_in_flight(started: float, ended: float, kills: list[float]) -> bool:
    return any(started <= kill + KILL_NOTICE_S and ended >= kill for kill in kills)


def final_class(attempt: Attempt, kills: list[float]) -> str:
    judged = attempt.judged
    in_flight = killed_in_flight(attempt.started, attempt.ended, kills)
    if judged.outcome == "failed" and judged.server_error and in_flight:
        return "killed_in_flight"
    return judged.outcome


def engine_core(api_pid: int, helpers: frozenset[int] = frozenset()) -> psutil.Process | None:
    """The API process's largest living child but `helpers`: the engine core."""
    children = []
    for child in psutil.Process(api_pid).children(recursive=True):
        if child.pid in helpers:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append((child.memory_info().rss, child))
        except psutil.Error:
            continue
    return max(children, key=lambda pair: pair[0])[1] if children else None


def usage(process: psutil.Process) -> dict[str, int]:
    return {"rss": process.memory_info().rss, "open_fds": process.num_fds()}


@dataclass
class CoreRecord:
    pid: int
    serving_since: float  # soak start for the first core, the end of recovery for others
    at_sample_age: dict[str, int | None] | None = None
    last: dict[str, int | None] | None = None  # the last reading: before its kill, or at the end


@dataclass
class Chaos:
    api_pid: int
    base_url: str
    kill_every_s: float
    sample_age_s: float
    kv_pool_ranges_dir: Path  # where each core publishes its KV pool (soak_memory.py)
    kills: list[float] = field(default_factory=list)
    recoveries_s: list[float | None] = field(default_factory=list)
    cores: list[CoreRecord] = field(default_factory=list)
    traffic_started: float = 0.0
    # The API process's other children (multiprocessing's resource tracker): while a killed
    # core is not yet replaced, one of them would be the largest child.
    helpers: frozenset[int] = frozenset()

    def watch(self, serving_since: float) -> None:
        core = engine_core(self.api_pid, self.helpers)
        if not self.cores and core is not None:
            children = psutil.Process(self.api_pid).children(recursive=True)
            self.helpers = frozenset(c.pid for c in children if c.pid != core.pid)
        if core is not None and (not self.cores or self.cores[-1].pid != core.pid):
            self.cores.append(CoreRecord(core.pid, serving_since))
        self.read_core()

    def read_core(self) -> None:
        if not self.cores:
            return
        record = self.cores[-1]
        try:
            reading = core_usage(psutil.Process(record.pid), self.kv_pool_ranges_dir)
        except (psutil.Error, ProcessLookupError, FileNotFoundError):  # killed meanwhile
            return
        if reading["rss"] == 0:  # killed, not yet reaped
            return
        record.last = reading
        if (
            record.at_sample_age is None
            and time.monotonic() - record.serving_since >= self.sample_age_s
        ):
            record.at_sample_age = reading

    async def monitor(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(MONITOR_EVERY_S)
            self.read_core()

    async def kill_loop(self, started: float, deadline: float) -> None:
        self.traffic_started = started
        number = 1
        while started + number * self.kill_every_s < deadline:
            await asyncio.sleep(max(0.0, started + number * self.kill_every_s - time.monotonic()))
            await self.kill_once()
            number += 1

    async def kill_once(self) -> None:
        self.read_core()
        core = engine_core(self.api_pid, self.helpers)
        if core is None:
            return
        self.kills.append(time.monotonic())
        core.kill()
        recovered = await self.wait_for_new_core(core.pid)
        self.recoveries_s.append(
            None if recovered is None else round(recovered - self.kills[-1], 1)
        )
        if recovered is not None:
            self.watch(recovered)

    async def wait_for_new_core(self, old_pid: int) -> float | None:
        """When /health answered 200 again with a core other than `old_pid` running."""
        give_up = time.monotonic() + RECOVERY_TIMEOUT_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < give_up:
                await asyncio.sleep(0.5)
                core = engine_core(self.api_pid, self.helpers)
                if core is None or core.pid == old_pid:
                    continue
                try:
                    async with session.get(self.base_url + "/health") as reply:
                        if reply.status == 200:
                            return time.monotonic()
                except (aiohttp.ClientError, OSError, TimeoutError):
                    continue
        return None

    def core_growth(self) -> dict:
        """The last core's RSS outside its KV pool at `sample_age_s` of serving against the
        first restarted core's (the first core's age does not count its start-up and
        warm-up: it is compared only when fewer than two restarted cores were read). Plain
        RSS is reported beside it: it counts however much of the pool the core touched."""
        sampled = [c for c in self.cores if _outside_pool(c.at_sample_age) is not None]
        restarted = [c for c in sampled if c is not self.cores[0]]
        if len(restarted) >= 2:
            sampled = restarted
        report: dict = {
            "definition": f"each core's RSS outside its KV pool {self.sample_age_s:.0f} s "
            "after it began serving (the first: the start of traffic; the others: the end of "
            "their recovery); growth = the last sampled core vs the first restarted one (vs "
            "the first core when fewer than two restarted cores were read)",
            "rss_outside_kv_pool": RSS_OUTSIDE_POOL_DEFINITION,
            "cores": [
                vars(c) | {"serving_since": round(c.serving_since - self.traffic_started, 1)}
                for c in self.cores
            ],
        }
        if sampled:
            first, last = sampled[0].at_sample_age, sampled[-1].at_sample_age
            report["rss_first"], report["rss_last"] = first["rss"], last["rss"]
            first_outside, last_outside = _outside_pool(first), _outside_pool(last)
            report["rss_outside_kv_pool_first"] = first_outside
            report["rss_outside_kv_pool_last"] = last_outside
            report["growth_percent"] = round(
                100.0 * (last_outside - first_outside) / first_outside, 2
            )
        return report


def _outside_pool(reading: dict[str, int | None] | None) -> int | None:
    return None if reading is None else reading["rss_outside_kv_pool"]
