"""The one `pagedllm serve --runner pooling` on the default model that a run's embedding
tests share (a server takes seconds to start): tests/entrypoints/test_embeddings_server.py
and the /v1/embeddings fuzzing of tests/fuzz/test_openapi_fuzz.py. tests/conftest.py makes
it a session fixture; a test asking for `pooling_server` gets it.

Its flags are the union of what those tests need: the fuzzing's short context (cheap
requests; the embedding tests' inputs fit in it) and unknown fields logged and ignored (the
default; the old switch is kept so launch lines that pass it stay exercised).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from entrypoints.server_utils import RunningServer, shared_server
from tiers import slow_fixture

MAX_MODEL_LEN = 256
POOLING_SERVER_ARGS = [
    "--runner", "pooling",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--allow-unknown-fields",
]  # fmt: skip


@pytest.fixture(scope="session")
@slow_fixture
def pooling_server(tmp_path_factory) -> Iterator[RunningServer]:
    yield from shared_server(tmp_path_factory, "pooling-server", POOLING_SERVER_ARGS)
