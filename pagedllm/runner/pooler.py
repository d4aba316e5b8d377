"""`Pooler`: turns a pooling request's final hidden states into its one vector.

A prompt may be prefilled over several steps (chunked prefill), so the pooler keeps, per
request, what the earlier chunks contributed: the running sum for mean pooling (fp32), the
first token's state for cls. The step that computes the prompt's last token yields the
vector, L2-normalized when the request asks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.pooling_params import PoolerConfig, PoolingParams


@dataclass
class _PoolState:
    normalize: bool
    num_prompt_tokens: int
    partial: torch.Tensor | None = None  # mean: the sum so far; cls: the first token's state


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.pooling_type = config.pooling_type
        self.default_normalize = config.normalize
        self._states: dict[str, _PoolState] = {}

    def add_request(
        self, request_id: str, params: PoolingParams | None, num_prompt_tokens: int
    ) -> None:
        normalize = params.normalize if params is not None else None
        if normalize is None:
            normalize = self.default_normalize
        self._states[request_id] = _PoolState(normalize, num_prompt_tokens)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def pool(
        self,
        req_ids: list[str],
        starts: list[int],
        counts: list[int],
        hidden_states: torch.Tensor,
    ) -> dict[str, list[float]]:
        """The vectors of the requests whose prompt this step finished. Request i's tokens
        are rows [sum(counts[:i]), +counts[i]) of `hidden_states`, prompt positions
        [starts[i], starts[i] + counts[i])."""
        pooled: dict[str, list[float]] = {}
        offset = 0
        for request_id, start, count in zip(req_ids, starts, counts, strict=True):
            state = self._states.get(request_id)
            if state is not None:
                chunk = hidden_states[offset : offset + count]
                vector = self._absorb(state, start, chunk)
                if vector is not None:
                    pooled[request_id] = self._finish(state, vector)
            offset += count
        return pooled

    def _absorb(self, state: _PoolState, start: int, chunk: torch.Tensor) -> torch.Tensor | None:
        """Take one chunk; the pooled (not yet normalized) vector once the prompt is whole."""
        if start == 0:  # its first chunk, or a recompute after preemption
            state.partial = None
        done = start + chunk.shape[0] >= state.num_prompt_tokens
        if self.pooling_type == "last":
            return chunk[-1].float() if done else None
        if self.pooling_type == "cls":
            if start == 0:
                state.partial = chunk[0].float()
            return state.partial if done else None
        chunk_sum = chunk.float().sum(dim=0)
        state.partial = chunk_sum if state.partial is None else state.partial + chunk_sum
        return state.partial / state.num_prompt_tokens if done else None

    @staticmethod
    def _finish(state: _PoolState, vector: torch.Tensor) -> list[float]:
        if state.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=0)
        return vector.cpu().tolist()
