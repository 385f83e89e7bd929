"""Rooms queued for one decode rank while its worker writes share one write and report their Success
in one ``RoomsDone``; the decode finishes each. Real Mooncake TCP and ZeroMQ on loopback: the prefill's
engine is told it merges writes (as the CUDA IPC engine does), its write sees the merged segments."""

from __future__ import annotations

import threading

from splitserve.transfer import KVPoll, KVReceiver, KVSender
from splitserve.transfer.control_messages import RoomsDone, TransferStatus

from .conftest import FAST, poll_until_final, wait_until
from .test_kv_transfer import SENTINEL, assert_landed

PREFIX = {3: 3}  # room 3's decode holds its first 3 tokens: planned apart, written with the others


def test_rooms_merged_into_one_write_report_success_in_one_message(bootstrap, make_rank):
    prefill = make_rank(seed=1, config=FAST.replace(transfer_threads=1))
    decode = make_rank(fill=SENTINEL)
    prefill.mgr.publish_layout(bootstrap.address)
    prefill.mgr.engine.merges_writes = True
    writes: list[int] = []
    gate = threading.Event()
    held = threading.Event()
    write = prefill.mgr.writers.write

    def gated_write(session, srcs, dsts, lens):
        writes.append(len(lens))
        if len(writes) == 2:  # the first room's own write (the first call is its handshake): hold it
            held.set()
            gate.wait(10)
        return write(session, [int(x) for x in srcs], [int(x) for x in dsts], [int(x) for x in lens])

    prefill.mgr.writers.write = gated_write
    sent: list = []
    send = prefill.mgr.send
    prefill.mgr.send = lambda endpoint, msg, **how: (sent.append(msg), send(endpoint, msg, **how))[1]
    rooms = list(range(40, 46))
    receivers = [KVReceiver(decode.mgr, bootstrap.address, room) for room in rooms]
    senders = [KVSender(prefill.mgr, bootstrap.address, room) for room in rooms]
    for i, (receiver, sender) in enumerate(zip(receivers, senders, strict=True)):
        receiver.init()
        receiver.send_metadata([20 + 2 * i, 21 + 2 * i], i, decode_prefix_len=PREFIX.get(i, 0))
        sender.init(2, i)
    assert wait_until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders), 5)
    senders[0].send([0, 1], True)
    assert held.wait(5)
    for i, sender in enumerate(senders[1:], start=1):  # queued behind the held write
        sender.send([2 * i, 2 * i + 1], True)
    gate.set()
    poll_until_final(senders + receivers)
    for i, (sender, receiver) in enumerate(zip(senders, receivers, strict=True)):
        assert sender.poll() == receiver.poll() == KVPoll.Success, (sender.failure_exception(),
                                                                    receiver.failure_exception())
        assert_landed(prefill.pool, decode.pool, [2 * i, 2 * i + 1], [20 + 2 * i, 21 + 2 * i], PREFIX.get(i, 0))
    per_room = writes[1]
    assert writes[2:] == [per_room * 5], writes  # the five queued rooms: one write
    assert prefill.mgr.workers.merged_writes == 1
    done = [m for m in sent if isinstance(m, RoomsDone)]
    assert len(done) == 1 and done[0].rooms == rooms[1:] and done[0].pages_done == [2] * 5
    successes = [m.room for m in sent if isinstance(m, TransferStatus) and m.state == KVPoll.Success]
    assert successes == rooms[:1]  # the first room wrote alone: its own message
    for sender, receiver in zip(senders, receivers, strict=True):
        sender.clear()
        receiver.clear()
    assert prefill.mgr.stats()["writes_in_flight"] == 0


def test_a_rooms_done_with_unequal_lists_is_dropped_and_finishes_nothing(bootstrap, make_rank):
    prefill, decode = make_rank(seed=2), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 50)
    receiver.init()
    receiver.send_metadata([1, 2], 0)
    sender = KVSender(prefill.mgr, bootstrap.address, 50)
    sender.init(2, 0)
    assert wait_until(lambda: receiver.poll() == KVPoll.WaitingForInput, 5)
    prefill.mgr.send(decode.mgr.endpoint, RoomsDone([50, 51], [2], bootstrap.address, prefill.mgr.endpoint,
                                                    prefill.mgr.instance_id, 0))
    # Behind it on the same socket: a progress notice, which a room already Success would not show.
    prefill.mgr.send(decode.mgr.endpoint, TransferStatus(50, bootstrap.address, prefill.mgr.endpoint,
                                                         prefill.mgr.instance_id, 0, int(KVPoll.Transferring), 0, ""))
    assert wait_until(lambda: receiver.poll() == KVPoll.Transferring, 5), receiver.poll()
    sender.send([3, 4], True)
    poll_until_final([sender, receiver])
    assert sender.poll() == receiver.poll() == KVPoll.Success
    sender.clear()
    receiver.clear()
