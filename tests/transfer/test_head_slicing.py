"""Prefill and decode with different tensor-parallel sizes: each decode rank gets exactly its heads."""

from __future__ import annotations

import time

import torch

from splitserve.transfer import AuxData, KVPoll, KVReceiver, KVSender, pack_aux, unpack_aux

from .conftest import poll_until_final

SENTINEL = -7.0
HEADS = 4


def test_two_prefill_ranks_feed_one_decode_rank_with_their_heads(bootstrap, make_rank):
    prefill = [make_rank(seed=20 + r, tp_size=2, tp_rank=r, num_kv_heads=HEADS, shape={"heads": 2})
               for r in range(2)]
    decode = make_rank(fill=SENTINEL, shape={"heads": HEADS})
    prefill[0].mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 31)
    receiver.init()
    receiver.send_metadata([9, 3, 4], 2, decode_prefix_len=6)  # prefix ends mid-page
    time.sleep(0.3)  # the bootstrap server answers 503 until rank 1 registers
    assert receiver.poll() == KVPoll.Bootstrapping
    prefill[1].mgr.publish_layout(bootstrap.address)
    senders = [KVSender(p.mgr, bootstrap.address, 31) for p in prefill]
    for p, sender in zip(prefill, senders, strict=True):
        pack_aux(p.aux, 1, AuxData(123, -0.125, 6))
        sender.init(3, 1)
        sender.send([5, 6], False)
        sender.send([7], True)
    poll_until_final([*senders, receiver])
    assert [s.poll() for s in senders] == [KVPoll.Success, KVPoll.Success]
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    got = decode.pool[:, :, [9, 3, 4]].flatten(2, 3)
    for r, p in enumerate(prefill):
        want = p.pool[:, :, [5, 6, 7]].flatten(2, 3)
        assert torch.equal(got[:, :, 6:, 2 * r:2 * r + 2], want[:, :, 6:])
    assert (got[:, :, :6] == SENTINEL).all()
    assert unpack_aux(decode.aux, 2) == AuxData(123, -0.125, 6)
    for room in (*senders, receiver):
        room.clear()


def test_one_prefill_rank_feeds_two_decode_ranks_their_halves(bootstrap, make_rank):
    prefill = make_rank(seed=30, shape={"heads": HEADS})
    decode = [make_rank(fill=SENTINEL, tp_size=2, tp_rank=r, num_kv_heads=HEADS, shape={"heads": 2})
              for r in range(2)]
    prefill.mgr.publish_layout(bootstrap.address)
    pack_aux(prefill.aux, 0, AuxData(7, -2.0, 0))
    receivers = [KVReceiver(d.mgr, bootstrap.address, 32) for d in decode]
    for receiver in receivers:
        receiver.init()
        receiver.send_metadata([1, 2], 5)
    sender = KVSender(prefill.mgr, bootstrap.address, 32)
    sender.init(2, 0)
    sender.send([10, 20], True)
    poll_until_final([sender, *receivers])
    assert sender.poll() == KVPoll.Success
    for r, (d, receiver) in enumerate(zip(decode, receivers, strict=True)):
        assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
        assert torch.equal(d.pool[:, :, [1, 2]], prefill.pool[:, :, [10, 20], :, 2 * r:2 * r + 2])
        assert unpack_aux(d.aux, 5) == AuxData(7, -2.0, 0)
    sender.clear()
    for receiver in receivers:
        receiver.clear()


def test_mismatched_page_size_fails_the_room_with_both_values(bootstrap, make_rank):
    prefill = make_rank(seed=40)
    decode = make_rank(shape={"page_size": 8})
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 33)
    receiver.init()
    receiver.send_metadata([1], 0)
    poll_until_final([receiver], timeout_s=5)
    assert "page_size expected 8, got 4" in str(receiver.failure_exception())
    receiver.clear()
