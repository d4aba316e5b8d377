"""`pagedllm run-batch`: one record per line, the server's answers (greedy) and the server's
errors for the same bodies, line errors for what is no request (hostile lines included), a
`--resume`d run that appends only what is missing (after a kill too), and embeddings on a
pooling engine equal to `LLM.embed`'s."""

from __future__ import annotations

import base64
import json

import httpx2 as httpx
import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.run_batch import (
    MAX_LINE_DEPTH,
    DoneSet,
    RecordWriter,
    read_requests,
    record_bytes,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {
    "chat-1": (CHAT, {"messages": [{"role": "user", "content": "What is 2+2?"}]}),
    "chat-2": (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a colour."},
            ]
        },
    ),
    "cmpl-1": (COMPLETIONS, {"prompt": ["The capital of France is", "One, two,"]}),
    # An unknown field is logged and ignored, by the server and run-batch alike.
    "cmpl-unknown": (COMPLETIONS, {"prompt": "hi", "frobnicate": 1}),
}
# Bodies the server refuses with a 400, and the field its error names.
BAD_BODIES = {
    "bad-temperature": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    "bad-type": (COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}),
}
BAD_PARAMS = {
    "bad-temperature": "temperature",
    "bad-type": "max_tokens",
}


def greedy(body: dict) -> dict:
    return {**body, "temperature": 0, "max_tokens": 16}


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture
def batch_file(tmp_path):
    lines = [line(cid, url, greedy(body)) for cid, (url, body) in GOOD.items()]
    lines += [line(cid, url, body) for cid, (url, body) in BAD_BODIES.items()]
    lines += [
        "{not json",
        line("bad-url", "/v1/nope", {}),
        line("embed-1", "/v1/embeddings", {"input": "hi"}),
        line("chat-1", CHAT, {"messages": [{"role": "user", "content": "again"}]}),  # duplicate
        "",  # blank lines are no requests
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_records(path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def test_run_batch_answers_as_the_server_and_resumes(server, batch_file, tmp_path):
    output = tmp_path / "results.jsonl"
    # An earlier run answered chat-2 and was killed while writing its next record.
    earlier = {"id": "batch_req_0", "custom_id": "chat-2", "response": None, "error": None}
    output.write_text(json.dumps(earlier) + '\n{"id": "batch_req_1", "custom_')
    flags = ["--max-num-seqs", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    argv = ["run-batch", "-i", str(batch_file), "-o", str(output), "--disable-progress-bar"]
    argv.append("--resume")
    assert main(argv + flags) == 0

    records = read_records(output)
    assert records[0] == earlier  # kept; the cut-short line is gone, chat-2 not run again
    by_id = {r["custom_id"]: r for r in records[1:]}
    # One record per non-blank line but chat-2's: 10 lines, one done before.
    assert len(records) - 1 == 9
    assert "chat-2" not in by_id
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as http:
        for custom_id in ("chat-1", "cmpl-1", "cmpl-unknown"):
            url, body = GOOD[custom_id]
            expected = http.post(url, json=greedy(body)).json()
            response = by_id[custom_id]["response"]
            assert response["status_code"] == 200 and by_id[custom_id]["error"] is None
            got = response["body"]
            assert got["id"] == response["request_id"]
            assert got["object"] == expected["object"] and got["model"] == expected["model"]
            assert got["usage"] == expected["usage"]
            assert [strip_ids(c) for c in got["choices"]] == [
                strip_ids(c) for c in expected["choices"]
            ]
        for custom_id, (url, body) in BAD_BODIES.items():
            expected = http.post(url, json=body)
            response = by_id[custom_id]["response"]
            assert response["status_code"] == expected.status_code == 400
            assert response["body"] == expected.json()
            assert response["body"]["error"]["param"] == BAD_PARAMS[custom_id]

    not_json = [r for r in records if (r["error"] or {}).get("code") == "invalid_json"]
    assert len(not_json) == 1 and not_json[0]["custom_id"] is None
    assert by_id["bad-url"]["error"]["code"] == "invalid_url"
    assert "--runner pooling" in by_id["embed-1"]["error"]["message"]
    duplicate = [r for r in records if (r["error"] or {}).get("code") == "duplicate_custom_id"]
    assert len(duplicate) == 1 and duplicate[0]["error"]["line"] == 10

    # Every line has its record now: a re-run adds nothing (and loads no model).
    before = output.read_text()
    assert main(argv + flags) == 0
    assert output.read_text() == before


def strip_ids(choice: dict) -> dict:
    return {k: v for k, v in choice.items() if k not in ("id", "created")}


def test_read_requests_skips_done_lines_and_refuses_duplicates():
    lines = [
        line("a", CHAT, {}),
        "[1, 2]",
        line("b", CHAT, {}),
        line("a", COMPLETIONS, {}),
        json.dumps({"custom_id": "c", "method": "GET", "url": CHAT, "body": {}}),
        json.dumps({"custom_id": "d", "method": "POST", "url": CHAT}),
        json.dumps({"custom_id": "e", "method": "POST", "url": CHAT, "body": {}, "x": 1}),
    ]
    skipped: list[int] = []
    items = list(read_requests(lines, DoneSet({"b"}, {2}), skipped))
    assert skipped == [2, 3]
    assert items[0].custom_id == "a"
    errors = [(i["custom_id"], i["error"]["code"], i["error"]["message"]) for i in items[1:]]
    assert [e[:2] for e in errors] == [
        (None, "duplicate_custom_id"),
        ("c", "invalid_request"),
        ("d", "missing_required_parameter"),
        ("e", "invalid_request"),
    ]
    assert (
        "method" in errors[1][2]
        and "body" in errors[2][2]
        and "unknown field(s): x" in errors[3][2]
    )


def test_run_batch_embeds_on_a_pooling_engine(tiny_llama, tmp_path):
    lines = [
        line("e-1", "/v1/embeddings", {"input": ["hello world", "the cat"]}),
        line("e-2", "/v1/embeddings", {"input": [1, 2, 3], "encoding_format": "base64"}),
        line("e-bad", "/v1/embeddings", {"input": "hi", "dimensions": 3}),
        line("c-1", CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    batch, output = tmp_path / "embed.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    engine = ["--model", str(tiny_llama), "--runner", "pooling", "--max-model-len", "256"]
    argv = ["run-batch", "-i", str(batch), "-o", str(output), "--disable-progress-bar"]
    assert main(argv + engine) == 0
    by_id = {r["custom_id"]: r for r in read_records(output)}

    llm = LLM(str(tiny_llama), runner="pooling", max_model_len=256)
    expected = [o.outputs.embedding for o in llm.embed(["hello world", "the cat", [1, 2, 3]])]
    body = by_id["e-1"]["response"]["body"]
    assert [d["index"] for d in body["data"]] == [0, 1]
    for data, vector in zip(body["data"], expected[:2], strict=True):
        assert data["embedding"] == pytest.approx(vector, abs=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    encoded = by_id["e-2"]["response"]["body"]["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == pytest.approx(expected[2], abs=1e-6)
    bad = by_id["e-bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "dimensions"
    error = by_id["c-1"]["error"]
    assert error["code"] == "unsupported_url" and "--runner generate" in error["message"]


# ---- hostile lines and killed runs ----------------------------------------------------------
def completion_line(custom_id: str, prompt: str = "hello world") -> str:
    return line(custom_id, COMPLETIONS, {"prompt": prompt, "max_tokens": 2, "temperature": 0})


def line_with_body(custom_id: str, body_json: str) -> str:
    head = json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS})
    return head[:-1] + ', "body": ' + body_json + "}"


# Each hostile line, and the custom_id its error record can still name (None: not at all).
HOSTILE = {
    "open brackets": ("[" * 100_000, None),
    "deep body": (line_with_body("deep", "[" * 5_000 + "]" * 5_000), "deep"),
    "long integer": (
        line_with_body("digits", '{"prompt": "hi", "max_tokens": ' + "7" * 5_000 + "}"),
        "digits",
    ),
    "lone surrogate id": (line_with_body("x\ud800y", '{"prompt": "hi"}'), None),
    "too long": (line_with_body("huge", json.dumps({"prompt": "word " * 50_000})), None),
}


def run_batch(tiny_llama, batch, output, *flags: str) -> int:
    argv = ["run-batch", "-i", str(batch), "-o", str(output), "--disable-progress-bar"]
    engine = ["--model", str(tiny_llama), "--max-model-len", "256", "--max-line-bytes", "200000"]
    return main(argv + engine + list(flags))


def strict_records(path) -> list[dict]:
    """The output's records; every line must be strict UTF-8 and standard JSON."""
    return [
        json.loads(text, parse_constant=_refuse) for text in path.read_bytes().decode().splitlines()
    ]


def _refuse(name: str):
    raise AssertionError(f"{name} in the output")


def test_hostile_lines_get_one_record_each_and_the_good_ones_are_answered(tiny_llama, tmp_path):
    lines = [completion_line("good-1").encode()]
    lines += [text.encode() for text, _ in HOSTILE.values()]
    lines.append(line_with_body("utf8", '{"prompt": "caf\xe9"}').encode("latin-1"))  # no UTF-8
    lines.append(completion_line("good-2").encode())
    batch, output = tmp_path / "hostile.jsonl", tmp_path / "out.jsonl"
    batch.write_bytes(b"\n".join(lines) + b"\n")
    assert run_batch(tiny_llama, batch, output) == 0

    records = strict_records(output)
    assert len(records) == len(lines)  # one per line, in input order
    for record in (records[0], records[-1]):
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert record["response"]["body"]["choices"][0]["text"]
    errors = records[1:-1]
    expected_ids = [custom_id for _, custom_id in HOSTILE.values()] + ["utf8"]
    assert [r["custom_id"] for r in errors] == expected_ids
    assert [r["error"]["line"] for r in errors] == list(range(2, len(lines)))
    assert all(r["response"] is None and r["id"].startswith("batch_req_") for r in errors)
    messages = [r["error"]["message"] for r in errors]
    assert f"at most {MAX_LINE_DEPTH} levels" in messages[0] and "deep" in messages[1]
    assert "5000 digits" in messages[2] and "lone surrogate" in messages[3]
    assert "at most 200000 are accepted" in messages[4] and "not valid UTF-8" in messages[5]
    codes = {r["error"]["code"] for r in errors}
    assert codes == {"invalid_json", "invalid_request", "line_too_large"}


def test_a_killed_run_resumed_answers_every_line_exactly_once(tiny_llama, tmp_path, monkeypatch):
    lines = [completion_line(f"c-{i}", f"count {i}") for i in range(6)]
    lines.insert(2, "{not json")  # a line without custom_id: resumed by its line number
    batch, output = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    written = []
    write = RecordWriter._write

    def killed_while_writing_the_fifth(self, data: bytes) -> None:
        if len(written) == 4:
            self.file.write(data[: len(data) // 2])  # half a record reaches the disk
            self.file.flush()
            raise KeyboardInterrupt  # as SIGKILL would, mid-run: nothing after runs
        written.append(data)
        write(self, data)

    monkeypatch.setattr(RecordWriter, "_write", killed_while_writing_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        run_batch(tiny_llama, batch, output)
    # Records went out as requests finished, before the engine call returned.
    assert output.read_bytes().count(b"\n") == 4 and not output.read_bytes().endswith(b"\n")
    monkeypatch.undo()

    assert run_batch(tiny_llama, batch, output) == 2  # refused without --resume
    assert run_batch(tiny_llama, batch, output, "--resume") == 0
    records = strict_records(output)
    assert len(records) == len(lines)
    assert sorted(r["custom_id"] or f"line {r['error']['line']}" for r in records) == sorted(
        [f"c-{i}" for i in range(6)] + ["line 3"]
    )
    assert (
        sum(r["response"] is not None and r["response"]["status_code"] == 200 for r in records) == 6
    )
    before = output.read_bytes()
    assert run_batch(tiny_llama, batch, output, "--resume") == 0  # nothing left: no change
    assert output.read_bytes() == before


def test_a_record_json_cannot_hold_becomes_an_error_record():
    record = {"id": "batch_req_1", "custom_id": "a\ud800", "response": {"x": float("nan")}}
    data = record_bytes(record, 7)
    fallback = json.loads(data.decode("utf-8"))
    assert fallback["custom_id"] is None and fallback["response"] is None
    assert fallback["error"]["code"] == "invalid_output" and fallback["error"]["line"] == 7
