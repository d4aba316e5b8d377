"""`POST /v1/embeddings` on a `--runner pooling` server (the run's shared one,
tests/pooling_server.py): the openai client's
`embeddings.create` (base64 on the wire) and raw float JSON both equal the offline
`LLM.embed`; inputs as text, texts, token ids or lists of them; usage counted; bad input is
a 400 naming the field."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from server_utils import API_KEY, MODEL

from pagedllm import LLM

TEXTS = ["Hi", "Paged attention keeps keys and values in fixed-size blocks. " * 6, "Paris"]


@pytest.fixture(scope="module")
def pooling_client(pooling_server):
    return openai.OpenAI(base_url=pooling_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    llm = LLM(runner="pooling")
    token_ids = [llm.get_tokenizer().encode(text) for text in TEXTS]
    vectors = [np.array(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]
    return token_ids, vectors


def assert_close(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert np.abs(np.asarray(a, dtype=np.float64) - e).max() < 1e-5


def test_openai_client_embeddings_equal_offline(pooling_client, offline):
    token_ids, vectors = offline
    response = pooling_client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    assert_close([d.embedding for d in response.data], vectors)
    num_tokens = sum(map(len, token_ids))
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert response.model == MODEL


def test_float_and_base64_formats_and_token_inputs(pooling_server, offline):
    token_ids, vectors = offline
    floats = pooling_server.post("/v1/embeddings", {"input": TEXTS[1]}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert_close([floats["data"][0]["embedding"]], vectors[1:2])
    packed = pooling_server.post(
        "/v1/embeddings", {"input": token_ids, "encoding_format": "base64"}
    ).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]]
    assert_close(decoded, vectors)
    one = pooling_server.post("/v1/embeddings", {"input": token_ids[2], "dimensions": 576})
    assert one.status_code == 200
    assert_close([one.json()["data"][0]["embedding"]], vectors[2:])
    assert one.json()["usage"]["prompt_tokens"] == len(token_ids[2])


def test_normalize_false_gives_the_raw_pooled_state(pooling_server, offline):
    _, vectors = offline
    raw = pooling_server.post("/v1/embeddings", {"input": "Paris", "normalize": False}).json()
    vector = np.array(raw["data"][0]["embedding"])
    assert np.linalg.norm(vector) > 1.5
    assert np.abs(vector / np.linalg.norm(vector) - vectors[2]).max() < 1e-5


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, 99999999]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "normalize": "maybe"}, "normalize"),
        ({"input": "x" * 10_000_000}, None),
        ({"input": "hi", "model": "other"}, "model"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(pooling_server, body, param):
    response = pooling_server.post("/v1/embeddings", body)
    assert 400 <= response.status_code < 500, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param, response.text


def test_an_unknown_field_is_ignored_as_vllm_does(pooling_server):
    """`stream` is no embeddings field: logged and ignored (a 400 with --strict-request-fields)."""
    response = pooling_server.post("/v1/embeddings", {"input": "hi", "stream": True})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "list"


def test_generation_and_embedding_routes_refuse_the_other_runner(pooling_server, server):
    chat = pooling_server.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 400 and "runner='pooling'" in chat.json()["error"]["message"]
    embedding = server.post("/v1/embeddings", {"input": "hi"})
    assert (
        embedding.status_code == 400 and "--runner pooling" in embedding.json()["error"]["message"]
    )
    assert pooling_server.get("/health").status_code == 200
