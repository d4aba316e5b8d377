"""One `pagedllm serve` on the default model for the whole clients suite (tests/clients), and
what every client needs to reach it: its base URL, the API key and the served model's name.

The clients are the packages vLLM users already point at a server (openai, LiteLLM,
LangChain, lm-eval, instructor), pinned in the `dev` extra (instructor: the Makefile). The
server is started once for the package (`__init__.py` makes the scope this folder) and
stopped after its last test, so the rest of a run does not hold its memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import openai
import pytest
from entrypoints.server_utils import API_KEY, RunningServer
from tiers import slow_fixture

# LiteLLM fetches its model price list from the network at import unless told not to; the
# machines running the tests reach none.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# lm-eval loads its local task files through `datasets`, which would ask the hub first.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tool calling with `tool_choice="auto"` needs the parser, as on vLLM. A small KV pool and
# context: the clients' requests are short, and the server should be cheap to hold.
SERVER_ARGS = [
    "--max-num-seqs", "8",
    "--max-model-len", "2048",
    "--kv-cache-memory", "256MiB",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--enable-tokenizer-info-endpoint",  # lm-eval's remote tokenizer reads it
]  # fmt: skip


@pytest.fixture(scope="package")
@slow_fixture
def server(tmp_path_factory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("clients-server") / "server.log"
    running = RunningServer(SERVER_ARGS, log, api_key=API_KEY)
    yield running
    assert running.stop() == 0, running.log()


@pytest.fixture(scope="package")
def base_url(server: RunningServer) -> str:
    """The OpenAI-style base URL every client takes (`.../v1`)."""
    return server.base_url + "/v1"


@pytest.fixture(scope="package")
def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
