"""The decode's layout travels once per prefill instance, then by digest; bad digests fail their room.

Real Mooncake TCP and ZeroMQ on loopback; a raw ZeroMQ peer for the malformed metadata."""

from __future__ import annotations

import time

import pytest
import zmq

from splitserve.transfer import KVMetadataError, KVPeerFailedError, KVPoll, KVReceiver, KVSender
from splitserve.transfer.control_messages import KVMetadata, TransferStatus, decode_message, encode_message
from splitserve.transfer.kv import manager as kv_manager_module
from splitserve.transfer.kv.layout import layout_digest

from .conftest import poll_until_final, wait_until
from .test_kv_transfer import SENTINEL, assert_landed


def capture_metadata(rank) -> list[KVMetadata]:
    """Every KVMetadata ``rank``'s manager sends from now on (the real send still happens)."""
    sent: list[KVMetadata] = []
    send = rank.mgr.send

    def recording_send(endpoint, msg, **how):
        if isinstance(msg, KVMetadata):
            sent.append(msg)
        return send(endpoint, msg, **how)

    rank.mgr.send = recording_send
    return sent


def one_room(prefill, decode, bootstrap, room: int, src: list[int], dst: list[int]) -> tuple[KVSender, KVReceiver]:
    receiver = KVReceiver(decode.mgr, bootstrap.address, room)
    receiver.init()
    receiver.send_metadata(dst, 0)
    sender = KVSender(prefill.mgr, bootstrap.address, room)
    sender.init(len(src), 0)
    sender.send(src, True)
    poll_until_final([sender, receiver])
    return sender, receiver


def test_layout_goes_with_the_first_room_only_then_its_digest(bootstrap, make_rank):
    prefill, decode = make_rank(seed=1), make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    sent = capture_metadata(decode)
    # Several rooms at once: the later ones' metadata name the layout only, and may reach senders first.
    receivers = [KVReceiver(decode.mgr, bootstrap.address, 100 + i) for i in range(6)]
    for i, receiver in enumerate(receivers):
        receiver.init()
        receiver.send_metadata([10 + 2 * i, 11 + 2 * i], i)
    assert wait_until(lambda: len(sent) == 6, 5)
    senders = [KVSender(prefill.mgr, bootstrap.address, 100 + i) for i in reversed(range(6))][::-1]
    for i, sender in enumerate(senders):
        sender.init(2, i)
        sender.send([2 * i, 2 * i + 1], True)
    poll_until_final(senders + receivers)
    for i, (sender, receiver) in enumerate(zip(senders, receivers, strict=True)):
        assert sender.poll() == receiver.poll() == KVPoll.Success, (sender.failure_exception(),
                                                                    receiver.failure_exception())
        assert_landed(prefill.pool, decode.pool, [2 * i, 2 * i + 1], [10 + 2 * i, 11 + 2 * i])
        sender.clear()
        receiver.clear()
    digest = layout_digest(decode.mgr.layout.to_dict())
    assert [m.dst_layout_digest for m in sent] == [digest] * 6
    assert sent[0].dst_layout == decode.mgr.layout.to_dict()
    assert [m.dst_layout for m in sent[1:]] == [{}] * 5


def test_a_forgotten_layout_fails_one_room_and_the_next_carries_it_again(bootstrap, make_rank, monkeypatch):
    """The prefill keeps one layout (cap 1): a second decode's evicts the first's, whose next room names
    an unknown digest: that room fails on both sides with the reason, the one after it goes through."""
    monkeypatch.setattr(kv_manager_module, "PEER_LAYOUTS_KEPT", 1)
    prefill = make_rank(seed=2)
    first, second = make_rank(fill=SENTINEL), make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    sent = capture_metadata(first)
    rooms = [one_room(prefill, first, bootstrap, 1, [0, 1], [4, 5]),
             one_room(prefill, second, bootstrap, 2, [2, 3], [6, 7])]
    assert all(s.poll() == r.poll() == KVPoll.Success for s, r in rooms)
    sender, receiver = one_room(prefill, first, bootstrap, 3, [4, 5], [8, 9])
    assert sender.poll() == receiver.poll() == KVPoll.Failed
    assert isinstance(sender.failure_exception(), KVMetadataError)
    assert "is not known here" in str(sender.failure_exception())
    assert isinstance(receiver.failure_exception(), KVPeerFailedError)
    assert "is not known here" in str(receiver.failure_exception())
    rooms.append((sender, receiver))
    rooms.append(one_room(prefill, first, bootstrap, 4, [6, 7], [10, 11]))
    assert rooms[-1][0].poll() == rooms[-1][1].poll() == KVPoll.Success
    assert_landed(prefill.pool, first.pool, [6, 7], [10, 11])
    assert [bool(m.dst_layout) for m in sent] == [True, False, True]
    for s, r in rooms:
        s.clear()
        r.clear()


@pytest.mark.parametrize("problem", ["corrupt", "other version", "no digest"])
def test_metadata_with_a_bad_digest_fails_its_room_with_the_reason(bootstrap, make_rank, problem):
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    raw, digest = decode.mgr.layout_dict()
    if problem == "corrupt":
        raw = {**raw, "buffers": [[ptr + 64, page, num] for ptr, page, num in raw["buffers"]]}
    elif problem == "other version":
        digest = "v0:" + digest.split(":", 1)[1]
    else:
        digest = ""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(prefill.mgr.endpoint)
    try:
        sender = KVSender(prefill.mgr, bootstrap.address, 9)
        sender.init(2, 0)
        push.send_multipart(encode_message(KVMetadata(
            room=9, bootstrap_addr=bootstrap.address, reply_to=f"tcp://127.0.0.1:{port}", instance="raw-peer",
            decode_rank=0, expected_dsts=1, dst_layout=raw, dst_layout_digest=digest, dst_pages=[1, 2],
            dst_aux_index=0, decode_prefix_len=0, head_start=0, head_count=decode.mgr.layout.head_count,
            write_aux=True, write_by=time.time() + 60)))
        assert wait_until(lambda: sender.poll() == KVPoll.Failed, 5)
        error = sender.failure_exception()
        want = {"corrupt": "does not match its digest", "other version": "is not of version v1",
                "no digest": "is not of version v1"}[problem]
        assert isinstance(error, KVMetadataError) and want in str(error), error
        deadline = time.monotonic() + 5
        status = None
        while status is None and time.monotonic() < deadline:  # heartbeats come too
            if pull.poll(100):
                msg = decode_message(pull.recv_multipart())
                if isinstance(msg, TransferStatus):
                    status = msg
        assert status is not None and status.room == 9 and status.state == KVPoll.Failed
        assert want in status.reason
        assert prefill.mgr.stats()["dropped_messages"] == 0
        sender.clear()
    finally:
        push.close()
        pull.close()
        ctx.term()
