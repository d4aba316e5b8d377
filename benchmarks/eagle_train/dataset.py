"""Training examples from the captured sequences: per sequence, the tokens the head reads
(x[p + 1]), the target's states (of p) and the labels (x[p + 2] as a draft id, ignored
where it is a prompt token or outside the draft vocabulary), in padded batches of similar
lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from benchmarks.eagle_train.capture import Sequence

IGNORE = -100


@dataclass
class Batch:
    token_ids: torch.Tensor  # [B, T]
    states: torch.Tensor  # [B, T, layers x hidden]
    labels: torch.Tensor  # [B, T] draft ids or IGNORE

    @property
    def num_labels(self) -> int:
        return int((self.labels != IGNORE).sum())


def example(sequence: Sequence, draft_ids: torch.Tensor, max_len: int):
    tokens = torch.tensor(sequence.token_ids, dtype=torch.long)
    length = min(len(tokens) - 2, max_len)
    labels = draft_ids[tokens[2 : 2 + length]].clone()
    positions = torch.arange(length)
    labels[positions + 2 < sequence.prompt_len] = IGNORE  # only the target's own tokens
    return tokens[1 : 1 + length], sequence.states[:length], labels


def make_batches(
    sequences: list[Sequence], draft_ids: torch.Tensor, batch_tokens: int, max_len: int
) -> list[Batch]:
    """Sequences by length, as many a batch as fit `batch_tokens` padded positions."""
    examples = [example(s, draft_ids, max_len) for s in sequences if len(s.token_ids) > 3]
    examples.sort(key=lambda e: len(e[0]))
    batches, group = [], []
    for item in examples:
        if group and len(item[0]) * (len(group) + 1) > batch_tokens:
            batches.append(_pad(group))
            group = []
        group.append(item)
    if group:
        batches.append(_pad(group))
    return [b for b in batches if b.num_labels]


def _pad(group) -> Batch:
    length = max(len(tokens) for tokens, _, _ in group)
    width = group[0][1].shape[1]
    token_ids = torch.zeros(len(group), length, dtype=torch.long)
    states = torch.zeros(len(group), length, width, dtype=group[0][1].dtype)
    labels = torch.full((len(group), length), IGNORE, dtype=torch.long)
    for row, (tokens, state, label) in enumerate(group):
        token_ids[row, : len(tokens)] = tokens
        states[row, : len(tokens)] = state
        labels[row, : len(tokens)] = label
    return Batch(token_ids, states, labels)


def split(sequences: list[Sequence], held_out: float, seed: int):
    """(train, validation) by a seeded shuffle."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    cut = int(len(order) * held_out)
    return [sequences[i] for i in order[cut:]], [sequences[i] for i in order[:cut]]
