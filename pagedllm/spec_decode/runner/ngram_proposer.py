"""Prompt-lookup (n-gram) proposer for speculative decoding (vLLM's ``method="ngram"``).

This module owns the model-free draft rule that copies tokens out of a request's own context:
find the longest n-gram (``prompt_lookup_min <= n <= prompt_lookup_max``) that ends the
sequence and also occurs earlier in it, and propose the tokens that followed that earlier
occurrence.

Semantics, following vLLM's v1 ``NgramProposer``:

* The longest matching n wins; among the occurrences of that n-gram the *earliest* one (the
  one that starts first in the sequence) is used.
* An occurrence may overlap the final n-gram itself; it only has to end before the last
  token, so at least one token follows it.
* Up to ``num_speculative_tokens`` tokens are proposed, fewer when the sequence ends first,
  and none when no n-gram in the range matches (or the sequence is shorter than
  ``prompt_lookup_min``).

The caller caps proposals at the model's context length (vLLM proposes at most
``max_model_len - len(token_ids)`` tokens); slicing the result does exactly that.
"""

import numpy as np

from pagedllm.spec_decode.config import check_positive_int

__all__ = ["NgramProposer"]


class NgramProposer:
    """Proposes draft tokens by prompt lookup over a request's verified tokens."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        check_positive_int("num_speculative_tokens", num_speculative_tokens)
        check_positive_int("prompt_lookup_min", prompt_lookup_min)
        check_positive_int("prompt_lookup_max", prompt_lookup_max)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({prompt_lookup_max})"
            )
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.prompt_lookup_min = int(prompt_lookup_min)
        self.prompt_lookup_max = int(prompt_lookup_max)

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Returns the tokens that followed the earliest occurrence of the longest n-gram
        ending ``token_ids``, or [] when no n-gram in [min, max] recurs."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
        match_end = self._earliest_longest_match_end(tokens)
        if match_end < 0:
            return []
        first_draft = match_end + 1
        return tokens[first_draft : first_draft + self.num_speculative_tokens].tolist()

    def _earliest_longest_match_end(self, tokens: np.ndarray) -> int:
        """Index of the last token of the earliest occurrence of the longest matching
        n-gram, or -1 when none of length >= prompt_lookup_min exists."""
        num_tokens = tokens.shape[0]
        if num_tokens < max(self.prompt_lookup_min, 2):
            return -1
        # Candidate occurrence ends are narrowed one token further back per round: an
        # occurrence of the last n tokens is also one of the last n-1, so the survivors of
        # round n are exactly the ends of earlier n-gram occurrences. One full vectorised
        # pass, then the candidate arrays shrink quickly on real text.
        ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[num_tokens - 1])
        best_end = -1
        longest_possible = min(self.prompt_lookup_max, num_tokens - 1)
        for ngram_len in range(1, longest_possible + 1):
            if ngram_len > 1:
                back = ngram_len - 1
                ends = ends[ends >= back]
                ends = ends[tokens[ends - back] == tokens[num_tokens - 1 - back]]
            if ends.size == 0:
                break
            if ngram_len >= self.prompt_lookup_min:
                # ends is ascending, so its head is the earliest occurrence.
                best_end = int(ends[0])
        return best_end
