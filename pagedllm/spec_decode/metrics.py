"""Speculative decoding's counters, under vLLM's names: drafts verified, draft tokens
proposed, draft tokens accepted, and accepted tokens per draft position."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.spec_decode.config import SpeculativeConfig


@dataclass
class SpecDecodingStats:
    """Totals since start-up. A draft is one request's proposals verified in one step."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i was accepted (then so were those before it).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def for_config(cls, config: SpeculativeConfig | None) -> SpecDecodingStats:
        num_spec_tokens = config.num_speculative_tokens if config is not None else 0
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def snapshot(self) -> SpecDecodeCounts | None:
        """The totals as sent with each step's stats (None when nothing speculates)."""
        if not self.num_spec_tokens:
            return None
        return SpecDecodeCounts(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.num_accepted_tokens_per_pos),
        )


@dataclass(frozen=True)
class SpecDecodeCounts:
    """An immutable copy of `SpecDecodingStats`' totals, for logs and /metrics."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying step of a request: the accepted drafts plus the one
        the target adds (vLLM's definition); 1 means no draft was ever accepted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def since(self, earlier: SpecDecodeCounts | None) -> SpecDecodeCounts:
        """What was counted after `earlier` (an older snapshot of the same totals)."""
        if earlier is None:
            return self
        return SpecDecodeCounts(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(
                now - before
                for now, before in zip(
                    self.num_accepted_tokens_per_pos,
                    earlier.num_accepted_tokens_per_pos,
                    strict=True,
                )
            ),
        )

    @staticmethod
    def sum(counts: list[SpecDecodeCounts | None]) -> SpecDecodeCounts | None:
        """Data-parallel cores' totals added up (None when none speculates)."""
        present = [c for c in counts if c is not None]
        if not present:
            return None
        width = max(len(c.num_accepted_tokens_per_pos) for c in present)
        per_pos = [0] * width
        for c in present:
            for position, count in enumerate(c.num_accepted_tokens_per_pos):
                per_pos[position] += count
        return SpecDecodeCounts(
            sum(c.num_drafts for c in present),
            sum(c.num_draft_tokens for c in present),
            sum(c.num_accepted_tokens for c in present),
            tuple(per_pos),
        )
