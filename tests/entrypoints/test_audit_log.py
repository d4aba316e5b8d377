"""The audit log's parts without a server: its writer thread and rotation, one tenant's lines,
and the middleware's line for each kind of response (plain, streamed, refused, cut off)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagedllm.entrypoints.openai.audit_log import (
    AuditLog,
    AuditMiddleware,
    audit_record,
    note_model,
    tenant_lines,
)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_are_written_by_the_writer_thread_without_blocking_the_caller(tmp_path, monkeypatch):
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    release = threading.Event()
    entered = threading.Event()
    real_write = log._file.write

    def slow_disk(text: str) -> int:
        entered.set()
        assert release.wait(30), "the test never released the disk"
        return real_write(text)

    monkeypatch.setattr(log._file, "write", slow_disk)
    log.write({"tenant": "a", "n": 1})
    assert entered.wait(30)
    # The disk is stuck in the writer; the caller (the event loop) queues on regardless.
    for n in range(2, 50):
        log.write({"tenant": "a", "n": n})
    assert threading.current_thread() is threading.main_thread()
    release.set()
    log.close()
    assert [line["n"] for line in read_lines(tmp_path / "audit.jsonl")] == list(range(1, 50))


def test_rotation_by_size_keeps_backup_count_files_and_tenant_lines_read_them_in_order(
    tmp_path,
):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), max_bytes=200, backup_count=2)
    for n in range(40):
        log.write({"tenant": "alice" if n % 2 == 0 else "bob", "n": n})
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    for file in tmp_path.iterdir():
        assert file.stat().st_size <= 200
    alice = [json.loads(line)["n"] for line in tenant_lines(str(path), "alice")]
    # The oldest lines went with the files past backup_count; what is left is in order.
    assert alice == sorted(alice) and alice[-1] == 38 and all(n % 2 == 0 for n in alice)
    assert len(alice) < 20


def test_tenant_lines_skip_a_line_cut_short_and_other_tenants(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(
        '{"tenant":"alice","n":1}\n{"tenant":"bob","n":2}\n{"tenant":"alice","n":3}\n'
        '{"tenant":"alice","n'
    )
    assert [json.loads(line)["n"] for line in tenant_lines(str(path), "alice")] == [1, 3]


def test_bad_rotation_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        AuditLog(str(tmp_path / "a"), max_bytes=0)


def _app(log: AuditLog) -> Starlette:
    async def plain(request):
        record = audit_record()
        record.tenant = "alice"
        note_model("base")
        return PlainTextResponse("ok")

    async def streamed(request):
        async def chunks():
            for part in ("a", "b", "c"):
                await asyncio.sleep(0)
                yield part

        return StreamingResponse(chunks())

    async def refused(request):
        return PlainTextResponse("no", status_code=401)

    async def broken(request):
        raise RuntimeError("the handler failed")

    async def load(request):
        note_model("my-adapter")
        return PlainTextResponse("loaded")

    routes = [
        Route("/plain", plain),
        Route("/streamed", streamed),
        Route("/refused", refused),
        Route("/broken", broken),
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/health", refused),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(AuditMiddleware, audit_log=log)
    return app


def test_the_middleware_writes_one_line_per_request_with_its_outcome(tmp_path):
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    client = TestClient(_app(log), raise_server_exceptions=False)
    assert client.get("/plain").text == "ok"
    assert client.get("/streamed").text == "abc"
    assert client.get("/refused").status_code == 401
    assert client.get("/broken").status_code == 500
    assert client.post("/v1/load_lora_adapter").status_code == 200
    assert client.get("/health").status_code == 401  # a probe: not audited
    log.close()
    lines = {line["path"]: line for line in read_lines(tmp_path / "audit.jsonl")}
    assert set(lines) == {"/plain", "/streamed", "/refused", "/broken", "/v1/load_lora_adapter"}
    assert lines["/plain"]["tenant"] == "alice" and lines["/plain"]["model"] == "base"
    assert lines["/plain"]["status"] == 200 and lines["/plain"]["event"] == "request"
    assert lines["/streamed"]["status"] == 200
    assert lines["/refused"]["status"] == 401
    assert lines["/broken"]["status"] == 500
    admin = lines["/v1/load_lora_adapter"]
    assert admin["event"] == "admin" and admin["action"] == "load_lora_adapter"
    assert admin["model"] == "my-adapter"
    for line in lines.values():
        assert line["total_time_s"] >= 0 and "prompts" not in line
        assert set(line) >= {"time", "tenant", "request_id", "prompt_tokens", "cached_tokens",
                             "completion_tokens", "finish_reasons", "queue_time_s"}  # fmt: skip


def test_a_response_cut_before_its_last_byte_is_a_499(tmp_path):
    """A stream whose client went away: headers and a first chunk sent, never the end."""
    log = AuditLog(str(tmp_path / "audit.jsonl"))

    async def cut_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})

    async def sent(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(AuditMiddleware(cut_stream, log)(scope, None, sent))
    log.close()
    (line,) = read_lines(tmp_path / "audit.jsonl")
    assert line["status"] == 499
