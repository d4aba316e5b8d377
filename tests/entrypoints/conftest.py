"""An offline engine to compare the session server (tests/session_server.py) against, and an
`openai` client of that server."""

from __future__ import annotations

import openai
import pytest
from server_utils import API_KEY

from pagedllm import LLM


@pytest.fixture(scope="session")
def llm():
    return LLM(max_num_seqs=64)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
