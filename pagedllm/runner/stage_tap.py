"""`StageTap`: the target layers an EAGLE-3 head reads, kept by the pipeline stage that runs
each and carried to the last stage beside the pipeline's own hand-over, so the head on the
last stage's sampling rank reads them all, in layer order, without a second pass.

Each stage's first tensor-parallel rank keeps the tapped layers of its own range
(`HiddenStateTap`; index `num_layers`, the last layer's output, on the last stage), and
after its forward sends what it received from the stage before with its own columns added;
the next stage's first rank receives as many columns (the ranks of a pipeline group share a
tensor-parallel index, so only the first ranks' group carries them). With one stage this is
the plain tap.
"""

from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator
from pagedllm.model.hidden_tap import HiddenStateTap


class StageTap:
    def __init__(
        self,
        layers: tuple[int, ...],
        stage_layers: range,
        num_layers: int,
        is_last_stage: bool,
        hidden_size: int,
    ) -> None:
        own = [i for i in layers if i in stage_layers or (is_last_stage and i == num_layers)]
        # Columns of the layers before this stage's, carried in from the stage before.
        self.num_carried_in = sum(1 for i in layers if i < stage_layers.start)
        self.hidden_size = hidden_size
        self.tap = HiddenStateTap(tuple(own)) if own else None
        self._carried: torch.Tensor | None = None

    @property
    def num_carried_out(self) -> int:
        return self.num_carried_in + (len(self.tap.layers) if self.tap is not None else 0)

    def receive(self, pp_group: GroupCoordinator, num_tokens: int, dtype: torch.dtype) -> None:
        """The earlier stages' columns of this step (after the hidden state and residual)."""
        if self.num_carried_in:
            shape = (num_tokens, self.num_carried_in * self.hidden_size)
            self._carried = pp_group.recv(shape, dtype)

    def send(self, pp_group: GroupCoordinator) -> None:
        """Every column so far to the next stage (after the hidden state and residual)."""
        if self.num_carried_out:
            pp_group.send(self.take())

    def take(self) -> torch.Tensor:
        """[tokens, columns]: the step's tapped layers up to this stage's, in layer order;
        nothing is kept after."""
        carried, self._carried = self._carried, None
        parts = [] if carried is None else [carried]
        if self.tap is not None:
            parts.append(self.tap.take())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
