"""One server on the default model for every server test module (it takes seconds to start),
an offline engine to compare against, and an `openai` client."""

from __future__ import annotations

import openai
import pytest
from server_utils import API_KEY, RunningServer
from tiers import slow_fixture

from pagedllm import LLM


@pytest.fixture(scope="session")
@slow_fixture
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-num-seqs", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--responses-store-size", "16"]  # /v1/responses' previous_response_id
    running = RunningServer(args, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()


@pytest.fixture(scope="session")
def llm():
    return LLM(max_num_seqs=64)


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
