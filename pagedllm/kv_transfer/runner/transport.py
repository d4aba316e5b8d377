"""KV blocks over TCP: a `KVSender` on the prefill instance, a `KVReceiver` on the decode one.

One message carries the sender's identity and a list of blocks; the receiver answers it with
one ack. The transport never interprets a block's bytes.

Wire (ZeroMQ DEALER -> ROUTER, both frames MessagePack by msgspec):
  sender:   [message id (8 bytes), KVTransferMessage(identity, blocks)]
  receiver: [message id, KVTransferAck(ok, reason)]
The message id pairs an ack with its message, so an ack that arrives after its sender gave
up is dropped instead of answering the next message.

Invariants:
- `KVSender.send` returns within its timeout, whether the peer is up, down, or never was;
  it returns True only once the receiver's `on_blocks` has returned for these blocks.
- After a failed send the sender's socket is rebuilt, so nothing queued for a dead peer is
  delivered later and the next send starts clean.
- The receiver's thread survives anything one message does (bad bytes, a foreign identity,
  an oversize message, `on_blocks` raising): it answers a refusal and serves the next one.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

logger = logging.getLogger("pagedllm")

POLL_INTERVAL_MS = 100  # how often the receiver's thread looks at its stop flag
# Frames between `max_message_bytes` and this much more are read and refused with a reason;
# larger ones make ZeroMQ drop the connection unread (the sender then times out).
MAX_MESSAGE_SLACK_BYTES = 1 << 20


class KVBlockPayload(msgspec.Struct):
    """One full KV block: its prefix-cache key and its bytes across every KV tensor."""

    key: str  # the block's chained hash, hex
    token_ids: list[int]
    parent_key: str | None
    data: bytes


class KVTransferMessage(msgspec.Struct):
    identity: str  # both instances must serve the same model and KV layout
    blocks: list[KVBlockPayload]


class KVTransferAck(msgspec.Struct):
    ok: bool
    reason: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_message = msgspec.msgpack.Decoder(KVTransferMessage).decode
_decode_ack = msgspec.msgpack.Decoder(KVTransferAck).decode


class KVSender:
    """Sends blocks to one `KVReceiver` and waits for its ack; safe to call from any thread."""

    def __init__(self, address: str, identity: str, timeout_s: float = 5.0) -> None:
        self.endpoint = f"tcp://{address}"
        self.identity = identity
        self.timeout_s = timeout_s
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._message_ids = itertools.count()
        self._lock = threading.Lock()

    def send(self, blocks: list[KVBlockPayload]) -> bool:
        """True once the receiver stored `blocks`; False (one warning) on any failure."""
        payload = _encode(KVTransferMessage(self.identity, blocks))
        with self._lock:
            try:
                error = self._send_and_wait(payload)
            except zmq.ZMQError as zmq_error:
                error = f"ZeroMQ error: {zmq_error}"
            if error is None:
                return True
            self._close_socket()  # a fresh socket next time: nothing stale is delivered
        logger.warning(
            "KV transfer of %d blocks to %s failed: %s", len(blocks), self.endpoint, error
        )
        return False

    def close(self) -> None:
        with self._lock:
            self._close_socket()

    def _send_and_wait(self, payload: bytes) -> str | None:
        """None on an ok ack, else why not."""
        deadline = time.monotonic() + self.timeout_s
        socket = self._connected_socket()
        message_id = next(self._message_ids).to_bytes(8, "little")
        if not socket.poll(_ms_left(deadline), zmq.POLLOUT):
            return f"could not send within {self.timeout_s} s"
        socket.send_multipart([message_id, payload], flags=zmq.NOBLOCK, copy=False)
        while socket.poll(_ms_left(deadline), zmq.POLLIN):
            frames = socket.recv_multipart(flags=zmq.NOBLOCK)
            if len(frames) != 2 or frames[0] != message_id:
                continue  # an ack to a message this sender already gave up on
            try:
                ack = _decode_ack(frames[1])
            except msgspec.DecodeError as error:
                return f"unreadable ack: {error}"
            return None if ack.ok else f"refused: {ack.reason}"
        return f"no ack within {self.timeout_s} s (receiver down or unreachable)"

    def _connected_socket(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


class KVReceiver:
    """Binds host:port and stores what senders send, one message at a time, in a daemon thread.

    `on_blocks` runs in that thread; the sender gets its ack only after it returned, so an
    ok ack means the blocks are stored. An exception from it is logged and answered as a
    failure.
    """

    def __init__(
        self,
        host: str,
        port: int,
        identity: str,
        on_blocks: Callable[[list[KVBlockPayload]], None],
        max_message_bytes: int,
    ) -> None:
        self.identity = identity
        self.on_blocks = on_blocks
        self.max_message_bytes = max_message_bytes
        # A context of its own: terminating it when the thread ends waits until ZeroMQ's I/O
        # thread has closed the listening socket, so the port is free once close() returns.
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + MAX_MESSAGE_SLACK_BYTES)
        try:
            self._socket.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as error:
            self._socket.close(linger=0)
            self._context.term()
            raise OSError(f"KV receiver cannot bind {host}:{port}: {error}") from error
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (within a poll interval, unless `on_blocks` is running); once it
        has stopped, the port is free."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                    frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    try:
                        self._answer(frames)
                    except zmq.ZMQError as error:  # this message's ack only
                        logger.warning("KV receiver: could not answer a message: %s", error)
        except Exception:
            logger.exception("KV receiver on port %d stopped", self.port)
        finally:
            self._socket.close(linger=0)
            self._context.term()

    def _answer(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 3:
            logger.warning("KV receiver: dropped a message of %d frames", len(frames))
            return
        routing_id, message_id, payload = frames
        ack = self._handle(payload.buffer)
        self._socket.send_multipart([routing_id, message_id, _encode(ack)], flags=zmq.NOBLOCK)

    def _handle(self, payload: memoryview) -> KVTransferAck:
        if payload.nbytes > self.max_message_bytes:
            return self._refuse(
                f"message of {payload.nbytes} bytes is over the limit of "
                f"{self.max_message_bytes} bytes"
            )
        try:
            message = _decode_message(payload)
        except msgspec.DecodeError as error:
            return self._refuse(f"unreadable message: {error}")
        if message.identity != self.identity:
            return self._refuse(
                f"identity mismatch: sender {message.identity!r}, receiver {self.identity!r}"
            )
        try:
            self.on_blocks(message.blocks)
        except Exception as error:
            logger.warning(
                "KV receiver: storing %d blocks failed", len(message.blocks), exc_info=True
            )
            return KVTransferAck(False, f"storing the blocks failed: {error!r}")
        return KVTransferAck(True)

    def _refuse(self, reason: str) -> KVTransferAck:
        logger.warning("KV receiver on port %d refused a message: %s", self.port, reason)
        return KVTransferAck(False, reason)


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
