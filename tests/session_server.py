"""The one `pagedllm serve` on the default model that every server test of a run shares (it
takes seconds to start): tests/entrypoints and tests/clients (the clients vLLM users point at
a server). tests/conftest.py makes it a session fixture; a test asking for `server` gets it.

Its flags are the union of what those tests need: tool calling with `tool_choice="auto"`
(the hermes parser, as on vLLM), a /v1/responses store for `previous_response_id`, and
/tokenizer_info for lm-eval's remote tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from entrypoints.server_utils import RunningServer, shared_server
from tiers import slow_fixture

SERVER_ARGS = [
    "--max-num-seqs", "64",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--responses-store-size", "16",
    "--enable-tokenizer-info-endpoint",
]  # fmt: skip


@pytest.fixture(scope="session")
@slow_fixture
def server(tmp_path_factory) -> Iterator[RunningServer]:
    yield from shared_server(tmp_path_factory, "server", SERVER_ARGS)
