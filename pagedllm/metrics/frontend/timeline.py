"""One timeline per sequence, kept once for every metrics sink (Prometheus, the dashboard).

`RequestTimelines` watches the engine from the API process (it is what an `AsyncLLM` step
observer sees): it opens a `RequestTimeline` when a request is added, moves it along as the
engine's outputs bring its tokens (the times the API process sees them arrive), and closes it
at its finish or abort. A request with n > 1 is n sequences: sample 0 under the request's own
id, the others (`core.request.child_request_id`) timed from their parent's arrival, with its
prompt and tenant. Each event goes to the sinks in turn (`TimelineSink`), which turn the same
timeline into their own series: `metrics.prometheus` and `metrics.timeseries`.

A sink is a step observer itself: it owns a `RequestTimelines` that feeds it alone, and
`follow` makes another sink consume that one's timelines instead of keeping its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.messages import EngineCoreOutput
from pagedllm.core.request import family_id, is_child_request
from pagedllm.metrics.stats import EngineStats


@dataclass
class RequestTimeline:
    """One sequence as the API process sees it, from its arrival to its finish."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    tenant: str
    parent_id: str | None = None  # a parallel sample's (n > 1) request
    first_scheduled_time: float | None = None  # as the output with its first token said
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_generation_tokens: int = 0
    # The engine reported this id itself (a parent that is sample 0 of its request).
    reported: bool = False
    open_samples: int = 0  # a parent's samples not finished yet
    engine_index: int = 0  # the data-parallel core whose outputs carried its tokens

    @property
    def time_to_first_token(self) -> float:
        assert self.first_token_time is not None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduling (None: the core did not say)."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def time_per_output_token(self) -> float | None:
        """The decode time over the tokens after the first (None for fewer than two)."""
        if self.first_token_time is None or self.num_generation_tokens <= 1:
            return None
        decode_time = self.last_token_time - self.first_token_time
        return decode_time / (self.num_generation_tokens - 1)

    # vLLM's phases of a finished request (its `FinishedRequestStats`), None before the first
    # token or when the core did not say when it was scheduled: the queue ends at the first
    # scheduling, the prefill at the first token, the decode at the last token, and inference
    # spans prefill and decode.
    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_token_time - self.first_scheduled_time)

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        prefill, decode = self.prefill_time, self.decode_time
        if prefill is None or decode is None:
            return None
        return prefill + decode

    def add_tokens(self, output: EngineCoreOutput, now: float) -> float | None:
        """Record the output's new tokens, seen at `now`. Returns the inter-token latency of
        each (the time since the last ones, shared out), None for the first tokens."""
        num_new = len(output.new_token_ids)
        gap = None
        if self.first_token_time is None:
            self.first_token_time = now
            self.first_scheduled_time = output.first_scheduled_time
        else:
            gap = (now - self.last_token_time) / num_new
        self.last_token_time = now
        self.num_generation_tokens += num_new
        return gap


class TimelineSink:
    """What consumes timelines: every hook does nothing unless a sink overrides it."""

    def __init__(self) -> None:
        self.timelines = RequestTimelines(self)

    def follow(self, sink: TimelineSink) -> None:
        """Feed `sink` this one's timelines too (it stops keeping its own)."""
        sink.timelines = self.timelines
        self.timelines.sinks.append(sink)

    # ---- StepObserver: the timelines' -----------------------------------------------------
    def on_request_added(
        self, request_id: str, arrival_time: float, num_prompt: int, tenant: str
    ) -> None:
        self.timelines.on_request_added(request_id, arrival_time, num_prompt, tenant)

    def on_step(
        self,
        outputs: list[EngineCoreOutput],
        stopped: list[str],
        stats: EngineStats,
        now: float,
        engine_index: int = 0,
    ) -> None:
        self.timelines.on_step(outputs, stopped, stats, now, engine_index)

    def on_request_aborted(self, request_ids: list[str], now: float) -> None:
        self.timelines.on_request_aborted(request_ids, now)

    # ---- the hooks ------------------------------------------------------------------------
    def on_timeline_started(self, timeline: RequestTimeline) -> None:
        """A request was added (its parallel samples start no timeline hook of their own)."""

    def on_engine_step(self, stats: EngineStats, now: float, engine_index: int) -> None:
        """A core's step, before its outputs: its stats snapshot."""

    def on_tokens(
        self, timeline: RequestTimeline | None, num_new: int, gap: float | None, now: float
    ) -> None:
        """`num_new` tokens arrived (the timeline already counts them); `gap`: each one's
        inter-token latency, None for the first. `timeline` None: a sequence not followed."""

    def on_finished(self, timeline: RequestTimeline, reason: str, now: float) -> None:
        """The sequence ended (`reason`: its finish reason, "abort" for an abort)."""


class RequestTimelines:
    """The open timelines by engine request id, and the sinks that see them."""

    def __init__(self, *sinks: TimelineSink) -> None:
        self.sinks = list(sinks)
        self.open: dict[str, RequestTimeline] = {}
        # Request id -> the ids of its open parallel samples (n > 1; sample 0, the request's
        # own id, is not one of them): what its abort must end besides itself.
        self._open_samples: dict[str, set[str]] = {}

    def on_request_added(
        self, request_id: str, arrival_time: float, num_prompt: int, tenant: str
    ) -> None:
        timeline = RequestTimeline(request_id, arrival_time, num_prompt, tenant)
        self.open[request_id] = timeline
        for sink in self.sinks:
            sink.on_timeline_started(timeline)

    def on_step(
        self,
        outputs: list[EngineCoreOutput],
        stopped: list[str],
        stats: EngineStats,
        now: float,
        engine_index: int = 0,
    ) -> None:
        for sink in self.sinks:
            sink.on_engine_step(stats, now, engine_index)
        stopped_ids = set(stopped)
        released: set[str] = set()
        for output in outputs:
            timeline = self._timeline(output.request_id)
            if timeline is not None:
                timeline.engine_index = engine_index
            if output.new_token_ids:
                gap = timeline.add_tokens(output, now) if timeline is not None else None
                for sink in self.sinks:
                    sink.on_tokens(timeline, len(output.new_token_ids), gap, now)
            if timeline is not None and (output.finished or output.request_id in stopped_ids):
                reason = output.finish_reason if output.finished else "stop"
                self._finish(timeline, reason or "stop", now, released)
        self._forget_released(released)

    def on_request_aborted(self, request_ids: list[str], now: float) -> None:
        released: set[str] = set()
        for request_id in request_ids:
            timeline = self.open.get(request_id)
            if not is_child_request(request_id):
                # A core's death forgets a request's samples before its handler aborts it,
                # by its own id alone: they end with it (else they would stay open forever).
                self._abort_samples(request_id, now, released)
            if timeline is not None:
                self._finish(timeline, "abort", now, released)
                continue
            # A parallel request whose samples never started (none reported): it ends itself.
            parent = self.open.get(family_id(request_id))
            if is_child_request(request_id) and parent is not None and _unstarted(parent):
                self._finish(parent, "abort", now, released)
        self._forget_released(released)

    def _timeline(self, request_id: str) -> RequestTimeline | None:
        timeline = self.open.get(request_id)
        if timeline is None and is_child_request(request_id):  # timed as its parent
            parent = self.open.get(family_id(request_id))
            if parent is not None:
                timeline = RequestTimeline(
                    request_id,
                    parent.arrival_time,
                    parent.num_prompt_tokens,
                    parent.tenant,
                    parent_id=parent.request_id,
                )
                self.open[request_id] = timeline
                self._open_samples.setdefault(parent.request_id, set()).add(request_id)
                parent.open_samples += 1
        if timeline is not None:
            timeline.reported = True
        return timeline

    def _finish(
        self, timeline: RequestTimeline, reason: str, now: float, released: set[str]
    ) -> None:
        del self.open[timeline.request_id]
        if timeline.parent_id is not None:
            self._forget_sample(timeline.parent_id, timeline.request_id)
        parent = self.open.get(timeline.parent_id) if timeline.parent_id is not None else None
        if parent is not None:
            parent.open_samples -= 1
            released.add(parent.request_id)
        for sink in self.sinks:
            sink.on_finished(timeline, reason, now)

    def _abort_samples(self, request_id: str, now: float, released: set[str]) -> None:
        for sample_id in sorted(self._open_samples.get(request_id, ())):
            self._finish(self.open[sample_id], "abort", now, released)

    def _forget_sample(self, request_id: str, sample_id: str) -> None:
        samples = self._open_samples.get(request_id)
        if samples is not None:
            samples.discard(sample_id)
            if not samples:
                del self._open_samples[request_id]

    def _forget_released(self, parent_ids: set[str]) -> None:
        """A parent the engine never reported itself (its samples carried every token) is
        forgotten, unfinished, once its last sample ends: it was no sequence of its own."""
        for parent_id in parent_ids:
            parent = self.open.get(parent_id)
            if parent is not None and _unstarted(parent):
                del self.open[parent_id]


def _unstarted(parent: RequestTimeline) -> bool:
    """Not reported itself and no sample open."""
    return not parent.reported and parent.open_samples == 0
