"""The audit log (`--audit-log FILE`): one JSON line per HTTP request and per admin action.

A request's line says who asked (tenant, request id, route, model or adapter), what it cost
(prompt, cached and completion tokens), how it ended (HTTP status, finish reasons) and how
long it took (time queued before its first scheduling, total time until its last byte). It
never holds a prompt unless `--audit-log-prompts` asks for it, and never a key. Admin
actions (adapter loads and unloads, key reloads) get lines of their own.

`AuditMiddleware`, outermost, opens a record for every request in a context variable; the
guard adds the tenant and request id, the serving code the model and what the engine
reported, and the record is written once the response's last byte is sent (or the request
failed). Lines go through a queue to one writer thread, so the event loop never waits on the
disk; the file is rotated by size (FILE.1 ... FILE.N, as logging's rotating handler).
A tenant's lines: `pagedllm audit-log FILE --tenant NAME` (rotated files included).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")

DEFAULT_MAX_BYTES = 100 * 1024 * 1024
DEFAULT_BACKUP_COUNT = 5
# Routes whose lines are admin actions (the action's name in the line).
ADMIN_ACTIONS = {
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
}
# Load balancers' probes: open to all, asking nothing, every few seconds.
UNAUDITED_PATHS = frozenset({"/health"})
# A request whose client went away before its answer ended (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
# Lines waiting for the writer; past this the newest are dropped and counted (a stuck disk
# must not grow the API process without bound).
MAX_PENDING_LINES = 100_000


@dataclass
class AuditRecord:
    """One HTTP request's line, filled in as the request goes through the server."""

    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    tenant: str | None = None
    request_id: str | None = None
    model: str | None = None
    status: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    queue_time_s: float | None = None
    prompts: list[str] | None = None

    def line(self, now: float) -> dict[str, Any]:
        action = ADMIN_ACTIONS.get(self.path)
        entry: dict[str, Any] = {
            "time": _wall_clock(),
            "event": "request" if action is None else "admin",
            **({} if action is None else {"action": action}),
            "tenant": self.tenant,
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "model": self.model,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reasons": self.finish_reasons,
            "queue_time_s": _rounded(self.queue_time_s),
            "total_time_s": _rounded(now - self.started),
        }
        if self.prompts is not None:
            entry["prompts"] = self.prompts
        return entry

    def add_output(self, output: RequestOutput) -> None:
        """A finished engine request of this HTTP request (one per prompt)."""
        self.prompt_tokens += len(output.prompt_token_ids or ())
        self.cached_tokens += output.num_cached_tokens
        for completion in output.outputs:
            self.completion_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finish_reasons.append(completion.finish_reason)
        metrics = output.metrics
        if metrics is not None and metrics.first_scheduled_time is not None:
            queued = max(0.0, metrics.first_scheduled_time - metrics.arrival_time)
            self.queue_time_s = max(self.queue_time_s or 0.0, queued)


current_audit: ContextVar[AuditRecord | None] = ContextVar("pagedllm_audit", default=None)


def note_model(model: str) -> None:
    """The model or adapter the current request names (an admin route's adapter)."""
    record = current_audit.get()
    if record is not None:
        record.model = model


def audit_record() -> AuditRecord | None:
    """The current request's record (None: no audit log, or outside a request)."""
    return current_audit.get()


def audited_outputs(
    results: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Pass a request's outputs through, adding each finished one to the audit record of the
    HTTP request this is called in (taken now: a streamed body is read in another task)."""
    record = current_audit.get()
    return results if record is None else _add_outputs(results, record)


async def _add_outputs(
    results: AsyncGenerator[tuple[int, RequestOutput], None], record: AuditRecord
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    async for index, output in results:
        if output.finished:
            record.add_output(output)
        yield index, output


class AuditLog:
    """JSON lines appended by one writer thread, the file rotated at `max_bytes`."""

    def __init__(
        self,
        path: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backup_count: int = DEFAULT_BACKUP_COUNT,
        include_prompts: bool = False,
    ) -> None:
        if max_bytes < 1 or backup_count < 0:
            raise ValueError(
                f"audit log: max_bytes must be >= 1 and backup_count >= 0, got {max_bytes} "
                f"and {backup_count}"
            )
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self.include_prompts = include_prompts
        self.num_dropped = 0
        self._pending: queue.Queue[str | None] = queue.Queue(MAX_PENDING_LINES)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._writer = threading.Thread(target=self._write_lines, name="audit-log", daemon=True)
        self._writer.start()

    def write(self, entry: dict[str, Any]) -> None:
        """Queue one line (never blocks: a full queue drops it, counted and logged once)."""
        line = json.dumps(entry, ensure_ascii=True, separators=(",", ":")) + "\n"
        try:
            self._pending.put_nowait(line)
        except queue.Full:
            if self.num_dropped == 0:
                logger.warning("audit log %s: the writer is behind; dropping lines", self.path)
            self.num_dropped += 1

    def admin(self, action: str, tenant: str | None, **details: Any) -> None:
        """An admin action's line (an adapter loaded or unloaded, the keys reloaded)."""
        self.write({"time": _wall_clock(), "event": "admin", "action": action,
                    "tenant": tenant, **details})  # fmt: skip

    def close(self) -> None:
        """Write what is queued, then close the file."""
        self._pending.put(None)
        self._writer.join()
        self._file.close()

    def _write_lines(self) -> None:
        while (line := self._pending.get()) is not None:
            if self._file.tell() + len(line) > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            self._file.write(line)
            if self._pending.empty():  # a burst is flushed once, a lone line at once
                self._file.flush()
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        if self.backup_count == 0:
            self.path.unlink(missing_ok=True)
        for index in range(self.backup_count, 0, -1):
            source = self.path if index == 1 else _backup(self.path, index - 1)
            if source.exists():
                os.replace(source, _backup(self.path, index))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115


class AuditMiddleware:
    """Opens an audit record for every HTTP request and writes it when the response ends.

    Plain ASGI (as the guard) so a streamed response is seen to its last byte, and
    outermost so refusals by the guard and the body limits are logged too.
    """

    def __init__(self, app: ASGIApp, audit_log: AuditLog) -> None:
        self.app = app
        self.audit_log = audit_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNAUDITED_PATHS:
            await self.app(scope, receive, send)
            return
        record = AuditRecord(scope["method"], scope["path"])
        if self.audit_log.include_prompts:
            record.prompts = []
        token = current_audit.set(record)
        written = False

        async def send_and_audit(message: Message) -> None:
            nonlocal written
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                written = True
                self.audit_log.write(record.line(time.monotonic()))

        failed = False
        try:
            await self.app(scope, receive, send_and_audit)
        except Exception:
            failed = True  # the server's error handler answers 500 out there
            raise
        finally:
            current_audit.reset(token)
            if not written:  # the app failed, or the client went away, before the last byte
                record.status = 500 if failed else CLIENT_CLOSED_REQUEST
                self.audit_log.write(record.line(time.monotonic()))


def tenant_lines(path: str, tenant: str) -> Iterator[str]:
    """The lines of `tenant` in the audit log at `path` and its rotated files, oldest first."""
    base = Path(path)
    backups = sorted(base.parent.glob(base.name + ".*"), key=_backup_index, reverse=True)
    for file in [*[b for b in backups if _backup_index(b) > 0], base]:
        if not file.exists():
            continue
        with open(file, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if isinstance(entry, dict) and entry.get("tenant") == tenant:
                    yield line.rstrip("\n")


def _backup(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def _backup_index(path: Path) -> int:
    suffix = path.name.rpartition(".")[2]
    return int(suffix) if suffix.isdigit() else 0


def _wall_clock() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
