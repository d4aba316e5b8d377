"""KVSender -> KVReceiver over TCP on 127.0.0.1: acks, refusals, timeouts, recovery, shutdown."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import zmq

from pagedllm.kv_transfer.runner.transport import (
    MAX_MESSAGE_SLACK_BYTES,
    KVBlockPayload,
    KVReceiver,
    KVSender,
)
from pagedllm.utils import free_port

HOST = "127.0.0.1"
IDENTITY = "model-a/fp32/block16"


class Store:
    """on_blocks that records what it was given, and can be told to raise."""

    def __init__(self) -> None:
        self.calls: list[list[KVBlockPayload]] = []
        self.fail_next = False
        self.lock = threading.Lock()

    def __call__(self, blocks: list[KVBlockPayload]) -> None:
        with self.lock:
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("pool full")
            self.calls.append(blocks)


@pytest.fixture
def log(pagedllm_log):
    return pagedllm_log


@pytest.fixture
def store() -> Store:
    return Store()


@pytest.fixture
def receiver(store):
    receiver = KVReceiver(HOST, 0, IDENTITY, store, max_message_bytes=1 << 20)
    yield receiver
    receiver.close()


@pytest.fixture
def sender(receiver):
    sender = KVSender(f"{HOST}:{receiver.port}", IDENTITY, timeout_s=5.0)
    yield sender
    sender.close()


def make_blocks(num_blocks: int, num_bytes: int = 1024) -> list[KVBlockPayload]:
    blocks, parent = [], None
    for i in range(num_blocks):
        key = f"{i:064x}"
        tokens = list(range(i * 16, (i + 1) * 16))
        blocks.append(KVBlockPayload(key, tokens, parent, os.urandom(num_bytes)))
        parent = key
    return blocks


def test_round_trip_of_several_blocks(receiver, sender, store):
    blocks = make_blocks(4)
    assert receiver.port > 0
    assert sender.send(blocks)
    # The ack comes after on_blocks returned: the blocks are stored by now.
    assert len(store.calls) == 1
    received = store.calls[0]
    assert [b.key for b in received] == [b.key for b in blocks]
    assert [b.parent_key for b in received] == [None, *[b.key for b in blocks[:-1]]]
    assert [b.token_ids for b in received] == [b.token_ids for b in blocks]
    assert [b.data for b in received] == [b.data for b in blocks]
    assert sender.send(make_blocks(1))  # the same socket serves the next message
    assert len(store.calls) == 2


def sender_warnings(log) -> list[str]:
    return [r.getMessage() for r in log.records if "KV transfer of" in r.getMessage()]


def test_sender_to_nobody_fails_within_its_timeout(log):
    sender = KVSender(f"{HOST}:{free_port()}", IDENTITY, timeout_s=0.5)
    assert not sender.send(make_blocks(2))
    # It gave up when its own timeout ran out (a hang would never return).
    warnings = [r for r in log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no ack within 0.5 s" in warnings[0].getMessage()
    sender.close()


def test_sender_recovers_once_the_receiver_starts(store):
    port = free_port()
    sender = KVSender(f"{HOST}:{port}", IDENTITY, timeout_s=0.5)
    try:
        assert not sender.send(make_blocks(1))
        assert not sender.send(make_blocks(1))
        receiver = KVReceiver(HOST, port, IDENTITY, store, max_message_bytes=1 << 20)
        try:
            assert receiver.port == port
            sender.timeout_s = 5.0
            blocks = make_blocks(3)
            assert sender.send(blocks)
            # Only the message sent while the receiver is up arrives, once.
            assert [[b.key for b in call] for call in store.calls] == [[b.key for b in blocks]]
        finally:
            receiver.close()
        # The peer goes away again: a timeout, not a hang; then it comes back.
        sender.timeout_s = 0.5
        assert not sender.send(make_blocks(1))
        receiver = KVReceiver(HOST, port, IDENTITY, store, max_message_bytes=1 << 20)
        try:
            sender.timeout_s = 5.0
            assert sender.send(make_blocks(2))
            assert len(store.calls) == 2
        finally:
            receiver.close()
    finally:
        sender.close()


def test_identity_mismatch_is_refused(receiver, store, log):
    sender = KVSender(f"{HOST}:{receiver.port}", "model-b/fp16/block16", timeout_s=5.0)
    try:
        assert not sender.send(make_blocks(2))
        assert store.calls == []
        # Refused at once, not timed out: the receiver's reason (in its ack) reaches the
        # sender's warning.
        sent = sender_warnings(log)
        assert len(sent) == 1 and "refused: identity mismatch" in sent[0]
    finally:
        sender.close()


def test_on_blocks_raising_is_a_failure_and_the_receiver_goes_on(receiver, sender, store):
    store.fail_next = True
    assert not sender.send(make_blocks(2))
    assert store.calls == []
    blocks = make_blocks(2)
    assert sender.send(blocks)
    assert [b.key for b in store.calls[0]] == [b.key for b in blocks]


def test_oversize_message_is_refused(store, log):
    receiver = KVReceiver(HOST, 0, IDENTITY, store, max_message_bytes=64 * 1024)
    sender = KVSender(f"{HOST}:{receiver.port}", IDENTITY, timeout_s=1.0)
    try:
        # Over the limit, within the slack: read and refused with a reason (an ack, so at
        # once rather than at the timeout).
        assert not sender.send(make_blocks(2, num_bytes=40 * 1024))
        assert "refused: message of" in sender_warnings(log)[-1]
        assert "over the limit" in sender_warnings(log)[-1]
        # Far over: ZeroMQ drops it unread; the sender times out.
        huge = make_blocks(1, num_bytes=64 * 1024 + MAX_MESSAGE_SLACK_BYTES + 1)
        assert not sender.send(huge)
        assert "no ack within 1.0 s" in sender_warnings(log)[-1]
        assert store.calls == []
        sender.timeout_s = 5.0
        assert sender.send(make_blocks(2, num_bytes=16 * 1024))  # a message within the limit
        assert len(store.calls) == 1
    finally:
        sender.close()
        receiver.close()


def test_unreadable_message_is_refused_and_the_receiver_goes_on(receiver, sender, store):
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"tcp://{HOST}:{receiver.port}")
        socket.send_multipart([b"id", b"\xc1 not msgpack"])
        assert socket.poll(5000)
        message_id, ack = socket.recv_multipart()
        assert message_id == b"id" and b"unreadable" in ack
        socket.send_multipart([b"only one frame is missing"])  # dropped, no answer
    finally:
        socket.close()
    assert sender.send(make_blocks(1))


def test_close_is_prompt(store):
    receiver = KVReceiver(HOST, 0, IDENTITY, store, max_message_bytes=1 << 20)
    sender = KVSender(f"{HOST}:{receiver.port}", IDENTITY, timeout_s=5.0)
    assert sender.send(make_blocks(1))
    receiver.close()  # joins its thread, which stops within a poll interval
    sender.close()
    assert not receiver._thread.is_alive()
    # The port is free again: a new receiver can bind it.
    again = KVReceiver(HOST, receiver.port, IDENTITY, store, max_message_bytes=1 << 20)
    again.close()
