"""Fixtures the multi-rank tests share."""

from __future__ import annotations

import pytest
from model_utils import greedy_with_logprobs
from parallel_greedy import MAX_TOKENS, SPEC_PROMPTS, budget_llm


@pytest.fixture(scope="session")
def plain_one_rank(tiny_llama) -> list:
    """One rank's greedy answers to SPEC_PROMPTS, no feature on (shared by the tests)."""
    return greedy_with_logprobs(budget_llm(tiny_llama), SPEC_PROMPTS, MAX_TOKENS)
