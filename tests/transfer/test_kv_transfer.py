"""KV transfer between two managers in one process: real Mooncake TCP and ZeroMQ on loopback."""

from __future__ import annotations

import random
import time

import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from splitserve.transfer import (
    AuxData,
    KVAbortedError,
    KVLengthMismatchError,
    KVPeerFailedError,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTimeoutError,
    RoomInUseError,
    TransferUsageError,
    pack_aux,
    unpack_aux,
)
from splitserve.transfer.control_messages import Ping, encode_message

from .conftest import FAST, poll_until_final, wait_until

SENTINEL = -7.0
ALL_STATES = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]


def assert_landed(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_pages: list[int], dst_pages: list[int],
                  prefix_len: int = 0, heads: slice = slice(None)) -> None:
    """Tokens from ``prefix_len`` on equal the source; the prefix keeps the sentinel."""
    page_size = src_pool.shape[3]
    src = src_pool[:, :, src_pages, :, heads].flatten(2, 3)
    dst = dst_pool[:, :, dst_pages].flatten(2, 3)
    assert torch.equal(dst[:, :, prefix_len:], src[:, :, prefix_len:]), "transferred tokens differ"
    assert (dst[:, :, :prefix_len] == SENTINEL).all(), "prefix tokens were overwritten"
    assert dst.shape[2] == len(dst_pages) * page_size


def test_many_rooms_non_contiguous_chunked_with_prefixes_arrive_intact(bootstrap, make_rank):
    prefill = make_rank(seed=1)
    decode = make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    rng = random.Random(3)
    src_free = list(range(prefill.pool.shape[2]))
    dst_free = list(range(decode.pool.shape[2]))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    page_size = prefill.pool.shape[3]
    plans = []
    for i in range(24):
        n = rng.randint(1, 6)
        src_pages, dst_pages = [src_free.pop() for _ in range(n)], [dst_free.pop() for _ in range(n)]
        prefix = rng.choice([0, 0, rng.randint(0, n * page_size)])
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        plans.append(dict(room=rng.getrandbits(63), src=src_pages, dst=dst_pages, prefix=prefix, chunks=chunks,
                          aux_src=i, aux_dst=31 - i, receiver_first=i % 2 == 0))
    senders, receivers = [], []
    for p in plans:
        pack_aux(prefill.aux, p["aux_src"], AuxData(1000 + p["aux_src"], -0.5 * p["aux_src"], p["prefix"]))
        if p["receiver_first"]:  # metadata may reach prefill before or after its sender exists
            receivers.append(KVReceiver(decode.mgr, bootstrap.address, p["room"]))
            receivers[-1].init()
            receivers[-1].send_metadata(p["dst"], p["aux_dst"], p["prefix"])
            senders.append(KVSender(prefill.mgr, bootstrap.address, p["room"]))
            senders[-1].init(len(p["src"]), p["aux_src"])
        else:
            senders.append(KVSender(prefill.mgr, bootstrap.address, p["room"]))
            senders[-1].init(len(p["src"]), p["aux_src"])
            receivers.append(KVReceiver(decode.mgr, bootstrap.address, p["room"]))
            receivers[-1].init()
            receivers[-1].send_metadata(p["dst"], p["aux_dst"], p["prefix"])
    for p, sender in zip(plans, senders, strict=True):  # chunked: the scheduler sends as prefill goes
        start = 0
        for k, size in enumerate(p["chunks"]):
            sender.send(p["src"][start:start + size], k == len(p["chunks"]) - 1)
            start += size
    observed = poll_until_final(senders + receivers)
    for p, sender, receiver, seen in zip(plans, senders, receivers, observed[len(senders):], strict=True):
        assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
        assert sender.poll() == KVPoll.Success, sender.failure_exception()
        assert list(sender.state_history) == ALL_STATES
        assert list(receiver.state_history) == ALL_STATES
        assert seen == sorted(seen) and seen[-1] == KVPoll.Success  # polls only ever see forward moves
        assert_landed(prefill.pool, decode.pool, p["src"], p["dst"], p["prefix"])
        aux = unpack_aux(decode.aux, p["aux_dst"])
        assert aux == AuxData(1000 + p["aux_src"], -0.5 * p["aux_src"], p["prefix"])
        sender.clear()
        receiver.clear()
    assert decode.mgr.stats()["rooms"] == prefill.mgr.stats()["rooms"] == 0


def test_whole_prompt_in_decode_prefix_sends_only_aux(bootstrap, make_rank):
    prefill, decode = make_rank(seed=2), make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    pack_aux(prefill.aux, 0, AuxData(5, -1.0, 8))
    receiver = KVReceiver(decode.mgr, bootstrap.address, 77)
    receiver.init()
    receiver.send_metadata([10, 11], 3, decode_prefix_len=8)
    sender = KVSender(prefill.mgr, bootstrap.address, 77)
    sender.init(2, 0)
    sender.send([0, 1], True)
    poll_until_final([sender, receiver])
    assert receiver.poll() == KVPoll.Success
    assert (decode.pool[:, :, [10, 11]] == SENTINEL).all()
    assert unpack_aux(decode.aux, 3) == AuxData(5, -1.0, 8)
    sender.clear()
    receiver.clear()


def test_sender_abort_reaches_receiver_at_once(bootstrap, make_rank):
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 5)
    receiver.init()
    receiver.send_metadata([1, 2], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 5)
    sender.init(2, 0)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 5)
    start = time.monotonic()
    sender.abort("prefill request cancelled")
    assert sender.poll() == KVPoll.Failed
    assert wait_until(lambda: receiver.poll() == KVPoll.Failed, 2)
    assert time.monotonic() - start < 1.0
    error = receiver.failure_exception()
    assert isinstance(error, KVAbortedError) and "prefill request cancelled" in str(error) and error.room == 5
    sender.clear()
    receiver.clear()


def test_receiver_abort_reaches_sender_at_once(bootstrap, make_rank):
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 6)
    receiver.init()
    receiver.send_metadata([1, 2], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 6)
    sender.init(2, 0)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 5)
    start = time.monotonic()
    receiver.abort("client went away")
    assert wait_until(lambda: sender.poll() == KVPoll.Failed, 2)
    assert time.monotonic() - start < 1.0
    assert isinstance(sender.failure_exception(), KVAbortedError)
    sender.send([0, 1], True)  # the scheduler may still send: ignored on a failed room
    assert sender.poll() == KVPoll.Failed
    sender.clear()
    receiver.clear()


def test_receiver_abort_before_sender_exists_fails_the_later_sender(bootstrap, make_rank):
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 8)
    receiver.init()
    receiver.send_metadata([1], 0)
    assert wait_until(lambda: receiver.poll() == KVPoll.WaitingForInput, 5)
    receiver.abort("decode out of memory")
    assert wait_until(lambda: prefill.mgr.stats()["early_metadata"] == 0, 2)
    time.sleep(0.05)
    sender = KVSender(prefill.mgr, bootstrap.address, 8)
    assert sender.poll() == KVPoll.Failed
    assert "decode out of memory" in str(sender.failure_exception())
    sender.clear()
    receiver.clear()


def test_clear_before_final_aborts_the_peer(bootstrap, make_rank):
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 9)
    receiver.init()
    receiver.send_metadata([1], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 9)
    sender.init(1, 0)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 5)
    sender.clear()
    assert wait_until(lambda: receiver.poll() == KVPoll.Failed, 2)
    receiver.clear()


def test_page_count_mismatch_fails_both_sides_with_the_lengths(bootstrap, make_rank):
    prefill, decode = make_rank(seed=4), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 11)
    receiver.init()
    receiver.send_metadata([1, 2, 3], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 11)
    sender.init(4, 0)
    poll_until_final([sender, receiver])
    error = sender.failure_exception()
    assert isinstance(error, KVLengthMismatchError)
    assert (error.room, error.expected, error.actual) == (11, 4, 3)
    assert isinstance(receiver.failure_exception(), KVPeerFailedError)
    assert "expected 4, got 3" in str(receiver.failure_exception())
    sender.clear()
    receiver.clear()


def test_chunks_overrunning_the_prompt_fail_the_room(bootstrap, make_rank):
    prefill = make_rank(seed=4)
    sender = KVSender(prefill.mgr, bootstrap.address, 12)
    sender.init(2, 0)
    sender.send([0], False)
    sender.send([1, 2], True)
    error = sender.failure_exception()
    assert sender.poll() == KVPoll.Failed and isinstance(error, KVLengthMismatchError)
    assert (error.expected, error.actual) == (2, 3)
    sender.clear()


def test_usage_errors_raise_and_duplicate_rooms_are_refused(bootstrap, make_rank):
    prefill, decode = make_rank(seed=4), make_rank()
    sender = KVSender(prefill.mgr, bootstrap.address, 13)
    with pytest.raises(TransferUsageError):
        sender.send([0], True)
    with pytest.raises(RoomInUseError):
        KVSender(prefill.mgr, bootstrap.address, 13)
    with pytest.raises(TransferUsageError):
        sender.init(1, 999)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 13)
    with pytest.raises(TransferUsageError):
        receiver.send_metadata([0], 0)
    receiver.init()
    with pytest.raises(TransferUsageError):
        receiver.send_metadata([0], 0, decode_prefix_len=5)
    sender.clear()
    receiver.clear()


def test_garbage_control_messages_are_dropped_and_the_thread_lives(bootstrap, make_rank):
    prefill, decode = make_rank(seed=5), make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(prefill.mgr.endpoint)
    garbage = [
        [b"hello"],
        [b"ss1", b"", b"{not json"],
        [b"ss1", b"", b"[1, 2]"],
        [b"ss1", b"", b'{"kind": "kv_metadata", "room": "x"}'],
        [b"ss1", b"", b'{"kind": "nope"}'],
        [b"ss1", b"", b'{"kind": "ping", "reply_to": 5, "instance": "i", "seq": 1}'],
        [b"ss1", b"", b"\xff\xfe" * 100],
    ]
    for frames in garbage:
        push.send_multipart(frames)
    # A well-formed message for an unknown room is harmless too.
    push.send_multipart(encode_message(Ping("tcp://127.0.0.1:1", "x", 1)))
    assert wait_until(lambda: prefill.mgr.stats()["dropped_messages"] == len(garbage), 5)
    push.close()
    ctx.term()
    receiver = KVReceiver(decode.mgr, bootstrap.address, 14)
    receiver.init()
    receiver.send_metadata([4, 5], 1)
    sender = KVSender(prefill.mgr, bootstrap.address, 14)
    sender.init(2, 1)
    sender.send([6, 7], True)
    poll_until_final([sender, receiver])
    assert receiver.poll() == KVPoll.Success
    assert_landed(prefill.pool, decode.pool, [6, 7], [4, 5])
    sender.clear()
    receiver.clear()


def test_control_key_rejects_unsigned_messages(bootstrap, make_rank):
    keyed = FAST.replace(transfer_control_key="s3cret")
    prefill, decode = make_rank(seed=6, config=keyed), make_rank(config=keyed)
    unkeyed = make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    unkeyed.mgr.send(prefill.mgr.endpoint, Ping(unkeyed.mgr.endpoint, "x", 1))
    assert wait_until(lambda: prefill.mgr.stats()["dropped_messages"] == 1, 5)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 15)
    receiver.init()
    receiver.send_metadata([1], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 15)
    sender.init(1, 0)
    sender.send([2], True)
    poll_until_final([sender, receiver])
    assert receiver.poll() == KVPoll.Success
    sender.clear()
    receiver.clear()


def test_waiting_timeout_fails_receiver_and_tells_the_sender(bootstrap, make_rank):
    short = FAST.replace(transfer_waiting_timeout_s=0.3)
    prefill, decode = make_rank(seed=7), make_rank(config=short)
    prefill.mgr.publish_layout(bootstrap.address)
    sender = KVSender(prefill.mgr, bootstrap.address, 16)
    sender.init(1, 0)  # prefill never computes the prompt: no send()
    receiver = KVReceiver(decode.mgr, bootstrap.address, 16)
    receiver.init()
    receiver.send_metadata([1], 0)
    poll_until_final([receiver], timeout_s=3)
    error = receiver.failure_exception()
    assert isinstance(error, KVTimeoutError) and error.state == "WaitingForInput" and error.timeout_s == 0.3
    assert wait_until(lambda: sender.poll() == KVPoll.Failed, 2)
    sender.clear()
    receiver.clear()


def test_bootstrap_timeout_when_no_decode_metadata_and_when_no_prefill(make_rank):
    short = FAST.replace(transfer_bootstrap_timeout_s=0.3)
    prefill, decode = make_rank(seed=8, config=short), make_rank(config=short)
    sender = KVSender(prefill.mgr, "127.0.0.1:1", 17)
    sender.init(1, 0)
    receiver = KVReceiver(decode.mgr, "127.0.0.1:1", 17)  # nothing listens there
    receiver.init()
    receiver.send_metadata([1], 0)
    poll_until_final([sender, receiver], timeout_s=3)
    for room in (sender, receiver):
        error = room.failure_exception()
        assert isinstance(error, KVTimeoutError) and error.state == "Bootstrapping"
    sender.clear()
    receiver.clear()


def test_metrics_count_bytes_and_rooms_in_the_given_registry(bootstrap, make_rank):
    registry = CollectorRegistry()
    prefill, decode = make_rank(seed=9, registry=registry), make_rank(registry=registry)
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 18)
    receiver.init()
    receiver.send_metadata([1, 2, 3], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 18)
    sender.init(3, 0)
    sender.send([4, 5, 6], True)
    poll_until_final([sender, receiver])
    layout = prefill.mgr.layout
    kv_bytes = 3 * layout.buffers[0].page_bytes * len(layout.buffers)
    assert registry.get_sample_value("splitserve_transfer_bytes_total", {"side": "receiver"}) == kv_bytes
    assert registry.get_sample_value("splitserve_transfer_bytes_total", {"side": "sender"}) == \
        kv_bytes + layout.aux.slot_bytes
    assert registry.get_sample_value("splitserve_transfer_rooms_total",
                                     {"side": "sender", "outcome": "success"}) == 1
    assert registry.get_sample_value("splitserve_transfer_latency_seconds_count", {"side": "receiver"}) == 1
    assert registry.get_sample_value("splitserve_transfer_wait_seconds_count", {"side": "sender"}) == 1
    sender.clear()
    receiver.clear()


def test_peer_sockets_and_heartbeats_stop_after_the_rooms_clear(bootstrap, make_rank):
    prefill, decode = make_rank(seed=10), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 19)
    receiver.init()
    receiver.send_metadata([1], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 19)
    sender.init(1, 0)
    sender.send([1], True)
    poll_until_final([sender, receiver])
    sender.clear()
    receiver.clear()
    for rank in (prefill, decode):
        assert wait_until(lambda r=rank: r.mgr.stats()["watched_peers"] == 0 and
                          r.mgr.stats()["peer_sockets"] == 0, 5), rank.mgr.stats()


def test_prefill_abort_room_before_its_sender_exists_fails_the_receiver_at_once(bootstrap, make_rank):
    prefill, decode = make_rank(seed=11), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 20)
    receiver.init()
    receiver.send_metadata([1], 0)
    assert wait_until(lambda: prefill.mgr.stats()["early_metadata"] == 1, 5)
    prefill.mgr.abort_room(20, "prompt too long")
    assert wait_until(lambda: receiver.poll() == KVPoll.Failed, 2)
    assert "prompt too long" in str(receiver.failure_exception())
    late = KVReceiver(decode.mgr, bootstrap.address, 21)  # metadata after the abort: refused too
    prefill.mgr.abort_room(21, "queue full")
    late.init()
    late.send_metadata([2], 0)
    assert wait_until(lambda: late.poll() == KVPoll.Failed, 2)
    receiver.clear()
    late.clear()


def test_decode_abort_room_without_a_receiver_fails_the_sender_at_once(bootstrap, make_rank):
    prefill, decode = make_rank(seed=12), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    sender = KVSender(prefill.mgr, bootstrap.address, 22)
    sender.init(1, 0)
    decode.mgr.abort_room(22, "client disconnected while queued", bootstrap_addr=bootstrap.address)
    assert wait_until(lambda: sender.poll() == KVPoll.Failed, 3)
    assert "client disconnected while queued" in str(sender.failure_exception())
    assert decode.mgr.stats()["pending_aborts"] == 0
    decode.mgr.abort_room(23, "again", bootstrap_addr=bootstrap.address)  # layout now cached
    later = KVSender(prefill.mgr, bootstrap.address, 23)
    assert wait_until(lambda: later.poll() == KVPoll.Failed, 2)
    sender.clear()
    later.clear()


def test_closing_a_manager_fails_the_peer_rooms_by_message_not_by_heartbeat(bootstrap, make_rank):
    # FAST's 0.5 s heartbeat timeout fails the room by silence whenever this process stalls that long
    # anywhere from init to close (it did under load), which is not what this test is about. With the
    # heartbeat timeout far above the wait below, only the close message can fail the room in time.
    patient = FAST.replace(transfer_heartbeat_misses=100)
    message_bound_s = patient.heartbeat_timeout_s / 4
    prefill, decode = make_rank(seed=13, config=patient), make_rank(config=patient)
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 24)
    receiver.init()
    receiver.send_metadata([1], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 24)
    sender.init(1, 0)
    assert wait_until(lambda: sender.poll() == KVPoll.WaitingForInput, 5)
    prefill.mgr.close()  # an engine shutting down tells its peers
    assert sender.poll() == KVPoll.Failed
    assert wait_until(lambda: receiver.poll() == KVPoll.Failed, message_bound_s)
    error = receiver.failure_exception()
    assert isinstance(error, KVPeerFailedError) and "transfer manager closed" in str(error)
    receiver.clear()
