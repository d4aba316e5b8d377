"""The head's draft vocabulary: the target tokens its generations use most, sorted by id,
with the published maps between the two vocabularies (`d2t`: target id minus draft id, per
draft id; `t2d`: which target ids are in the draft vocabulary)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    target_ids: torch.Tensor  # [draft vocabulary], ascending target ids
    target_vocab_size: int

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(len(self.target_ids))

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def draft_ids(self) -> torch.Tensor:
        """[target vocabulary]: each target id's draft id, -100 (ignored) when outside."""
        table = torch.full((self.target_vocab_size,), -100, dtype=torch.long)
        table[self.target_ids] = torch.arange(len(self.target_ids))
        return table


def most_frequent(counted: list[list[int]], size: int, target_vocab_size: int) -> DraftVocab:
    """The `size` most frequent ids of `counted` (ties by id); when fewer are seen, the
    lowest unseen ids fill the rest, so the vocabulary always has `size` tokens."""
    size = min(size, target_vocab_size)
    counts = Counter(token for tokens in counted for token in tokens)
    chosen = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    seen = set(chosen)
    filler = (t for t in range(target_vocab_size) if t not in seen)
    while len(chosen) < size:
        chosen.append(next(filler))
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), target_vocab_size)
