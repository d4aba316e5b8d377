"""Logprobs as replies carry them: always JSON numbers, whatever the model produced."""

from __future__ import annotations

import json
import math

import pytest

from pagedllm.entrypoints.openai.serving import MIN_LOGPROB, clamp_logprob


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (-0.5, -0.5),
        (0.0, 0.0),
        (-1e6, MIN_LOGPROB),
        (-math.inf, MIN_LOGPROB),
        (math.nan, MIN_LOGPROB),
    ],
)
def test_a_logprob_is_always_a_json_number(value, expected):
    clamped = clamp_logprob(value)
    assert clamped == expected
    json.dumps(clamped, allow_nan=False)  # raises on inf and NaN
