"""What every client of tests/clients needs to reach the session server (tests/session_server.py,
the one the server tests share): its base URL, the API key and the served model's name.

The clients are the packages vLLM users already point at a server (openai, LiteLLM,
LangChain, lm-eval, instructor), pinned in the `dev` extra (instructor: the Makefile).
"""

from __future__ import annotations

import os

import openai
import pytest
from entrypoints.server_utils import API_KEY, RunningServer

# LiteLLM fetches its model price list from the network at import unless told not to; the
# machines running the tests reach none.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# lm-eval loads its local task files through `datasets`, which would ask the hub first.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="package")
def base_url(server: RunningServer) -> str:
    """The OpenAI-style base URL every client takes (`.../v1`)."""
    return server.base_url + "/v1"


@pytest.fixture(scope="package")
def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
