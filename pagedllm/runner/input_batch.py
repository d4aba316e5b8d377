"""The runner's persistent batch: one row of numpy arrays per request it holds.

Rows survive across steps (and across preemption) so a step only writes what changed:
new requests, new blocks, the token sampled last step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.logits_processors import LogitsProcessorState
from pagedllm.sampling_params import SamplingParams


class InputBatch:
    def __init__(
        self,
        max_model_len: int,
        max_blocks_per_req: int,
        num_rows: int = 16,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_model_len = max_model_len
        # Seeded rows' generators live where sampling runs.
        self.device = torch.device(device)
        # One spare column: the token sampled at max_model_len is stored before the stop check.
        self.token_ids = np.zeros((num_rows, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(num_rows, dtype=np.int64)
        self.block_table = np.zeros((num_rows, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        # -1: not asked for; else how many alternatives to return.
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.generators: dict[int, torch.Generator] = {}
        # Only rows with penalties, biases, bans or min_tokens have one.
        self.logits_states: dict[int, LogitsProcessorState] = {}
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def row(self, request_id: str) -> int:
        return self.req_id_to_row[request_id]

    def add_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        vocab_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.req_id_to_row[request_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_blocks[row] = 0
        self.temperature[row] = 0.0 if params.is_greedy else params.temperature
        self.top_k[row] = vocab_size if params.top_k == -1 else min(params.top_k, vocab_size)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = (
            -1 if params.prompt_logprobs is None else params.prompt_logprobs
        )
        self.num_prompt_tokens[row] = len(token_ids)
        if params.seed is not None:
            self.generators[row] = torch.Generator(device=self.device).manual_seed(params.seed)
        state = LogitsProcessorState(
            prompt_token_ids=list(token_ids),
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
            allowed_token_ids=params.allowed_token_ids,
            bad_words_token_ids=bad_words_token_ids,
            min_tokens=params.min_tokens,
            stop_token_ids=params.stop_token_ids,
            eos_token_ids=eos_token_ids,
        )
        if state.needs_processing():
            self.logits_states[row] = state
        return row

    def remove_request(self, request_id: str) -> None:
        row = self.req_id_to_row.pop(request_id, None)
        if row is not None:
            self.generators.pop(row, None)
            self.logits_states.pop(row, None)
            self._free_rows.append(row)

    def set_blocks(self, row: int, block_ids: list[int], replace: bool) -> None:
        start = 0 if replace else int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def write_tokens(self, row: int, start: int, token_ids: list[int], to_end: bool) -> None:
        """A rank that does not sample learns a running request's tokens from the scheduler:
        `token_ids` from position `start`, which are its last ones when `to_end`."""
        end = start + len(token_ids)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end if to_end else max(int(self.num_tokens[row]), end)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        if self.logits_states:
            for row, token_id in zip(rows.tolist(), token_ids.tolist(), strict=True):
                state = self.logits_states.get(row)
                if state is not None:
                    state.append_output_token(token_id)

    def _grow(self) -> None:
        """Double the rows of every per-row array (add_request fills a row before use)."""
        old = self.num_rows
        for name, array in list(vars(self).items()):
            if isinstance(array, np.ndarray):
                grown = np.zeros((old * 2, *array.shape[1:]), dtype=array.dtype)
                grown[:old] = array
                setattr(self, name, grown)
        self._free_rows = list(range(2 * old - 1, old - 1, -1))


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array of the batch (or one laid out from it) as a tensor on `device`."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
