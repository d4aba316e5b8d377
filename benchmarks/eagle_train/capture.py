"""The target's generations with the hidden states an EAGLE-3 head reads, in one pass: the
engine generates as usual while a `HiddenStateTap` on the target keeps the tapped layers of
every forward (prompt and decode steps), handed to a forward observer and filed by request.
Prefix caching is off so that every position of every sequence is computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.hidden_tap import HiddenStateTap


@dataclass
class Sequence:
    """One prompt and its generation: `token_ids` (prompt then output) and `states`
    ([len(token_ids) - 1, layers x hidden]: the last token is never forwarded)."""

    token_ids: list[int]
    prompt_len: int
    states: torch.Tensor


class StateRecorder:
    """Files the tap's states of each forward under the requests the step scheduled."""

    def __init__(self, llm: LLM, layers: tuple[int, ...], dtype: torch.dtype) -> None:
        runner = llm.model_runner
        assert runner is not None, "the recorder reads the runner in this process"
        self.runner = runner
        self.tap = HiddenStateTap(layers)
        self.dtype = dtype
        self.pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._scheduled: list[tuple[str, int]] = []
        self._execute = runner.execute_model

    def __enter__(self) -> StateRecorder:
        self.runner.model.model.hidden_tap = self.tap
        self.runner.execute_model = self._record_schedule
        self.runner.add_forward_observer(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.runner.remove_forward_observer(self._observe)
        del self.runner.execute_model  # the class's method again
        self.runner.model.model.hidden_tap = None

    def _record_schedule(self, scheduler_output):
        # The forward's tokens are the scheduled requests' in this order (model_runner).
        self._scheduled = list(scheduler_output.num_scheduled_tokens.items())
        return self._execute(scheduler_output)

    def _observe(self, step) -> None:
        states = self.tap.take().to(self.dtype)
        positions = step.positions
        offset = 0
        for request_id, count in self._scheduled:
            piece = states[offset : offset + count]
            self.pieces.setdefault(request_id, []).append((int(positions[offset]), piece))
            offset += count

    def assemble(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The request's states at positions 0 .. num_tokens - 2 (a recomputed position:
        its last forward's)."""
        width = len(self.tap.layers) * self.runner.model.config.hidden_size
        out = torch.zeros(num_tokens - 1, width, dtype=self.dtype)
        filled = torch.zeros(num_tokens - 1, dtype=torch.bool)
        for start, piece in self.pieces.pop(request_id):
            end = min(start + len(piece), num_tokens - 1)
            out[start:end] = piece[: end - start]
            filled[start:end] = True
        if not bool(filled.all()):
            raise RuntimeError(f"request {request_id}: some positions were never computed")
        return out


def generate_with_states(
    llm: LLM,
    prompts: list[str],
    layers: tuple[int, ...],
    max_tokens: int,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Sequence]:
    """Greedy generations of `prompts` with the target's states at `layers`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with StateRecorder(llm, layers, dtype) as recorder:
        outputs = llm.generate(prompts, params, use_tqdm=True)
        sequences = []
        for output in outputs:
            token_ids = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
            states = recorder.assemble(output.request_id, len(token_ids))
            sequences.append(Sequence(token_ids, len(output.prompt_token_ids), states))
    return sequences
