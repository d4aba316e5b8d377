"""What a pipeline stage hands the next one, and the placeholder for layers of other stages.

A stage builds only its own decoder layers (`pipeline_stage_layers`); the others are
`PPMissingLayer`s, so checkpoint names (`model.layers.<i>.`) keep their indices. A stage
that is not the last returns `IntermediateTensors` (the hidden states and the residual
stream) instead of normed hidden states; the runner sends them to the next stage, whose
forward takes them in place of the embedding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class IntermediateTensors(NamedTuple):
    """[num_tokens, hidden_size] each, in the model's dtype. A tuple, so the runner sends
    and receives it as `(hidden_states, residual)` and may pass a plain pair back in."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage runs: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a layer of another pipeline stage was called")
