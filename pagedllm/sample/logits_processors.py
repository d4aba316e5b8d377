"""Per-request logits adjustments, applied batched before temperature / top-k / top-p.

This module owns vLLM's logits adjustments and the per-request state they need
(`LogitsProcessorState`, kept by the model runner). `apply_logits_processors` applies them to a
`[num_rows, vocab]` float32 logits tensor (other float dtypes work, rounded after each step;
vLLM converts to float32 first), in vLLM's order:

1. allowed_token_ids: every other token gets -inf.
2. bad_words: a single-token bad word is always -inf; a multi-token one bans its last token when
   the output so far ends with its preceding tokens.
3. min_tokens: while the output is shorter than min_tokens, EOS and stop token ids get -inf.
4. logit_bias: bias added to the token's logit.
5. penalties: repetition (tokens in prompt or output: positive logits divided by the penalty,
   others multiplied), frequency (minus penalty x count in the output), presence (minus penalty
   once for each token in the output).

Rows whose state is None or needs nothing are never indexed, and a batch where no row needs
anything returns the input tensor without any tensor work. Each adjustment is one batched
index operation over the rows that use it; penalties gather, adjust and scatter back only the
positions of each row's distinct prompt/output tokens, so their cost never grows with
rows x vocab. Output-token counts are kept incrementally (`append_output_token`): a step costs
O(1) Python per penalized row and never rescans the history.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

_NEG_INF = float("-inf")
_T = TypeVar("_T")


@dataclass
class LogitsProcessorState:
    """One request's adjustment options and the running output statistics they need.

    Options are read once (lazily cached as arrays), so set them at construction. Output tokens
    may be added with `append_output_token` or appended to `output_token_ids` directly (e.g. a
    list shared with the request); counts catch up with the list before each use.
    """

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()

    # Distinct output tokens and their counts: _distinct_ids[:n] / _counts[:n] with
    # n = len(_slot_of); arrays grow by doubling so an append is amortized O(1).
    _slot_of: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _distinct_ids: np.ndarray = field(init=False, repr=False, compare=False)
    _counts: np.ndarray = field(init=False, repr=False, compare=False)
    _num_counted: int = field(default=0, init=False, repr=False, compare=False)
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._distinct_ids = np.empty(16, dtype=np.int64)
        self._counts = np.empty(16, dtype=np.float32)
        self._sync_counts()

    # ---- which options are on ----------------------------------------------------------

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def min_tokens_active(self) -> bool:
        """True while the output is short of min_tokens and there is something to mask."""
        return len(self.output_token_ids) < self.min_tokens and bool(
            self.stop_token_ids or self.eos_token_ids
        )

    def needs_processing(self) -> bool:
        # min_tokens counts only while it still masks something, so a row that has reached
        # it stops paying for it.
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
            or self.min_tokens_active
        )

    # ---- output tokens ---------------------------------------------------------------

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._sync_counts()

    def output_token_counts(self) -> dict[int, int]:
        """Count of each distinct output token (kept only when a penalty is on)."""
        ids, counts = self.distinct_output()
        return {int(t): int(c) for t, c in zip(ids, counts, strict=True)}

    @property
    def num_distinct(self) -> int:
        return len(self._slot_of)

    def distinct_output(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct output token ids, their counts as float32), both up to date."""
        self._sync_counts()
        n = self.num_distinct
        return self._distinct_ids[:n], self._counts[:n]

    def _sync_counts(self) -> None:
        # Only penalties read counts; other rows skip the bookkeeping entirely.
        if not self.has_penalties:
            return
        tokens = self.output_token_ids
        if len(tokens) < self._num_counted:  # the list was replaced or truncated: recount
            self._slot_of.clear()
            self._num_counted = 0
        for token_id in tokens[self._num_counted :]:
            self._count(token_id)
        self._num_counted = len(tokens)

    def _count(self, token_id: int) -> None:
        slot = self._slot_of.get(token_id)
        if slot is None:
            slot = len(self._slot_of)
            if slot == len(self._distinct_ids):
                self._distinct_ids = np.concatenate([self._distinct_ids, self._distinct_ids])
                self._counts = np.concatenate([self._counts, self._counts])
            self._slot_of[token_id] = slot
            self._distinct_ids[slot] = token_id
            self._counts[slot] = 0.0
        self._counts[slot] += 1.0

    # ---- option arrays, built once -----------------------------------------------------

    def _cached(self, key: str, build: Callable[[], _T]) -> _T:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def prompt_distinct_ids(self) -> np.ndarray:
        return self._cached(
            "prompt", lambda: np.unique(np.asarray(self.prompt_token_ids, np.int64))
        )

    def allowed_ids(self) -> np.ndarray:
        return self._cached("allowed", lambda: np.asarray(self.allowed_token_ids, np.int64))

    def min_tokens_ban_ids(self) -> np.ndarray:
        return self._cached(
            "min_tokens",
            lambda: np.asarray(sorted({*self.stop_token_ids, *self.eos_token_ids}), np.int64),
        )

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        bias = self.logit_bias or {}
        ids = self._cached("bias_ids", lambda: np.fromiter(bias.keys(), np.int64, len(bias)))
        values = self._cached(
            "bias_values", lambda: np.fromiter(bias.values(), np.float32, len(bias))
        )
        return ids, values

    def bad_word_ban_ids(self) -> list[int]:
        """Tokens the bad words ban at this step (given the output so far)."""
        single, by_prefix_end = self._cached("bad_words", self._index_bad_words)
        banned = list(single)
        tokens = self.output_token_ids
        # Only bad words whose prefix ends with the last output token can match now.
        for prefix, last in by_prefix_end.get(tokens[-1], ()) if tokens else ():
            if len(tokens) >= len(prefix) and tokens[-len(prefix) :] == prefix:
                banned.append(last)
        return banned

    def _index_bad_words(self) -> tuple[list[int], dict[int, list[tuple[list[int], int]]]]:
        single: list[int] = []
        by_prefix_end: dict[int, list[tuple[list[int], int]]] = {}
        for word in self.bad_words_token_ids or []:
            if len(word) == 1:
                single.append(word[0])
            elif word:
                prefix = list(word[:-1])
                by_prefix_end.setdefault(prefix[-1], []).append((prefix, word[-1]))
        return single, by_prefix_end


def apply_logits_processors(
    logits: torch.Tensor, states: list[LogitsProcessorState | None]
) -> torch.Tensor:
    """Return adjusted logits (may modify in place). Row i uses states[i]; None or a state with
    needs_processing() False leaves the row untouched. If no row needs anything, return logits
    unchanged without any tensor work."""
    if len(states) != logits.shape[0]:
        raise ValueError(f"{len(states)} states for {logits.shape[0]} logits rows")
    active = [(i, s) for i, s in enumerate(states) if s is not None and s.needs_processing()]
    if not active:
        return logits
    _apply_allowed_token_ids(logits, [(i, s) for i, s in active if s.allowed_token_ids is not None])
    _apply_bans(logits, active)
    _apply_logit_bias(logits, [(i, s) for i, s in active if s.logit_bias])
    _apply_penalties(logits, [(i, s) for i, s in active if s.has_penalties])
    return logits


def _ragged(
    rows: list[int], per_row: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flatten ragged per-row id arrays: (row index, column index, length of each row's part)."""
    lengths = np.fromiter((len(a) for a in per_row), np.int64, len(per_row))
    row_idx = np.repeat(np.asarray(rows, np.int64), lengths)
    col_idx = np.concatenate(per_row) if per_row else np.empty(0, np.int64)
    return row_idx, col_idx, lengths


def _ragged_indices(
    rows: list[int], per_row: list[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column index) tensors for ragged per-row id arrays, one transfer each."""
    row_idx, col_idx, _ = _ragged(rows, per_row)
    return torch.from_numpy(row_idx).to(device), torch.from_numpy(col_idx).to(device)


def _apply_allowed_token_ids(
    logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]
) -> None:
    if not active:
        return
    rows, cols = _ragged_indices(
        [i for i, _ in active], [s.allowed_ids() for _, s in active], logits.device
    )
    # Save the allowed logits, blank the whole rows, put the saved ones back: no [R, V] mask.
    kept = logits[rows, cols]
    logits.index_fill_(0, torch.tensor([i for i, _ in active], device=logits.device), _NEG_INF)
    logits[rows, cols] = kept


def _apply_bans(logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]) -> None:
    """bad_words and min_tokens: one -inf index_put for the whole batch."""
    rows: list[int] = []
    per_row: list[np.ndarray] = []
    for i, state in active:
        if state.bad_words_token_ids:
            banned = state.bad_word_ban_ids()
            if banned:
                rows.append(i)
                per_row.append(np.asarray(banned, np.int64))
        if state.min_tokens_active:
            rows.append(i)
            per_row.append(state.min_tokens_ban_ids())
    if not rows:
        return
    row_idx, col_idx = _ragged_indices(rows, per_row, logits.device)
    logits[row_idx, col_idx] = _NEG_INF


def _apply_logit_bias(logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]) -> None:
    if not active:
        return
    arrays = [s.logit_bias_arrays() for _, s in active]
    rows, cols = _ragged_indices([i for i, _ in active], [ids for ids, _ in arrays], logits.device)
    bias = torch.from_numpy(np.concatenate([b for _, b in arrays])).to(logits.device, logits.dtype)
    # A dict has distinct keys, so accumulate adds each bias exactly once.
    logits.index_put_((rows, cols), bias, accumulate=True)


def _apply_penalties(logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]) -> None:
    """Repetition, then frequency and presence, in vLLM's order.

    A penalty changes only the logits of tokens in the row's prompt or output, so only those
    positions are gathered, adjusted and scattered back: the cost follows the rows' distinct
    tokens, never rows x vocab. Per element the arithmetic is vLLM's dense formula's."""
    repetition = [(i, s) for i, s in active if s.repetition_penalty != 1.0]
    if repetition:
        _apply_repetition_penalty(logits, repetition)
    additive = [(i, s) for i, s in active if s.frequency_penalty or s.presence_penalty]
    if additive:
        _apply_frequency_presence(logits, additive)


def _apply_repetition_penalty(
    logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]
) -> None:
    device = logits.device
    per_row = [np.concatenate([s.prompt_distinct_ids(), s.distinct_output()[0]]) for _, s in active]
    row_idx, col_idx, lengths = _ragged([i for i, _ in active], per_row)
    penalties = np.repeat(
        np.asarray([s.repetition_penalty for _, s in active], np.float32), lengths
    )
    rows, cols = torch.from_numpy(row_idx).to(device), torch.from_numpy(col_idx).to(device)
    # A token in both prompt and output appears twice, but both copies are computed from the
    # same gathered logit, so the scatter writes one value twice: penalized once, no dedupe.
    values = logits[rows, cols].float()
    penalty = torch.from_numpy(penalties).to(device)
    values = torch.where(values > 0, values / penalty, values * penalty)
    logits[rows, cols] = values.to(logits.dtype)


def _apply_frequency_presence(
    logits: torch.Tensor, active: list[tuple[int, LogitsProcessorState]]
) -> None:
    device = logits.device
    outputs = [s.distinct_output() for _, s in active]  # distinct ids: no duplicate positions
    row_idx, col_idx, lengths = _ragged([i for i, _ in active], [ids for ids, _ in outputs])
    if not len(col_idx):
        return

    def per_entry(values: list[float]) -> torch.Tensor:
        return torch.from_numpy(np.repeat(np.asarray(values, np.float32), lengths)).to(device)

    rows, cols = torch.from_numpy(row_idx).to(device), torch.from_numpy(col_idx).to(device)
    counts = torch.from_numpy(np.concatenate([c for _, c in outputs])).to(device)
    values = logits[rows, cols].float()
    # Two subtractions, as vLLM: frequency x count, then presence once.
    values = values - per_entry([s.frequency_penalty for _, s in active]) * counts
    values = values - per_entry([s.presence_penalty for _, s in active])
    logits[rows, cols] = values.to(logits.dtype)
