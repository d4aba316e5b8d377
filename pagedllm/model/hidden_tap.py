"""`HiddenStateTap`: the residual stream at chosen layers of a forward, kept for a reader
outside the model (a speculative EAGLE-3 head) so that it needs no second pass.

Layer index `i` is the stream entering decoder layer `i` (the output of layer `i - 1`, its
residual add done), as vLLM counts EAGLE-3's auxiliary layers; index `num_layers` is the last
layer's output before the final norm. A reader of the normed output (EAGLE, Medusa) needs no
tap: it is what the model's forward returns.
"""

from __future__ import annotations

import torch


class HiddenStateTap:
    def __init__(self, layers: tuple[int, ...]) -> None:
        # Kept in layer order, as the forward meets them (the order vLLM concatenates in).
        self.layers = tuple(sorted(set(layers)))
        self._kept: list[torch.Tensor] = []

    def keep(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The stream at one tapped layer: a decoder layer's output with its residual add
        (the models leave that add to the next norm)."""
        # A copy before any layer: the first norm's fused residual add writes into x.
        self._kept.append(x.clone() if residual is None else x + residual)

    def take(self) -> torch.Tensor:
        """[tokens, len(layers) * hidden]: the last forward's streams side by side; the tap
        is empty again after."""
        if len(self._kept) != len(self.layers):
            raise RuntimeError(
                f"the hidden-state tap kept {len(self._kept)} layers of {len(self.layers)}: "
                "the forward did not run every tapped layer"
            )
        kept, self._kept = self._kept, []
        return torch.cat(kept, dim=-1)

    def clear(self) -> None:
        self._kept = []
