"""The transfer layer across processes: bytes intact, kill -9 on either side, a restarted peer reused."""

from __future__ import annotations

import random
import socket
import time

import pytest
import torch

from splitserve.transfer import AuxData, KVPeerLostError, KVPoll, KVReceiver, KVSender, unpack_aux

from .conftest import HEARTBEAT_MISSES, HEARTBEAT_S, SHAPE, fill_pool, poll_until_final, wait_until

DIMS = (SHAPE["layers"], 2, SHAPE["pages"], SHAPE["page_size"], SHAPE["heads"], SHAPE["head_dim"])
# Heartbeat timeout plus one interval of tick jitter plus scheduling slack on a busy 2-core box.
DEAD_PEER_BOUND_S = HEARTBEAT_S * HEARTBEAT_MISSES + 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_many_rooms_across_processes_arrive_intact(spawn_peer, make_rank):
    prefill = spawn_peer({"role": "prefill", "seed": 7})
    decode = make_rank()
    src_pool = fill_pool(DIMS, 7)
    rng = random.Random(5)
    src_free, dst_free = list(range(DIMS[2])), list(range(DIMS[2]))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    plans = []
    for i in range(16):
        n = rng.randint(1, 6)
        plans.append(dict(room=rng.getrandbits(63), src=[src_free.pop() for _ in range(n)],
                          dst=[dst_free.pop() for _ in range(n)], aux_index=i,
                          chunks=[1] * n, chunk_delay=0.01))
    prefill.command("send", rooms=[{"room": p["room"], "pages": p["src"], "aux_index": p["aux_index"],
                                    "chunks": p["chunks"], "chunk_delay": p["chunk_delay"],
                                    "aux": [p["aux_index"], 0.5, 0]} for p in plans])
    receivers = []
    for p in plans:
        receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], p["room"])
        receiver.init()
        receiver.send_metadata(p["dst"], p["aux_index"])
        receivers.append(receiver)
    observed = poll_until_final(receivers, timeout_s=20)
    report = prefill.result(20)["rooms"]
    for p, receiver, seen in zip(plans, receivers, observed, strict=True):
        assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
        assert torch.equal(decode.pool[:, :, p["dst"]], src_pool[:, :, p["src"]])
        assert unpack_aux(decode.aux, p["aux_index"]) == AuxData(p["aux_index"], 0.5, 0)
        assert seen == sorted(seen)
        assert list(receiver.state_history) == [1, 2, 3, 4]
        sender_side = report[str(p["room"])]
        assert sender_side["state"] == KVPoll.Success and sender_side["history"] == [1, 2, 3, 4]
        assert sender_side["observed"] == sorted(sender_side["observed"])
        receiver.clear()


@pytest.mark.slow
def test_kill9_sender_mid_transfer_fails_receivers_within_heartbeat_bound_then_restart_is_used(
        spawn_peer, make_rank):
    port = free_port()
    prefill = spawn_peer({"role": "prefill", "seed": 7, "bootstrap_port": port})
    decode = make_rank()
    rooms = [101, 102, 103, 104]
    prefill.command("send", rooms=[{"room": room, "pages": list(range(8 * i, 8 * i + 8)), "aux_index": i,
                                    "chunks": [1] * 8, "chunk_delay": 0.5} for i, room in enumerate(rooms)])
    receivers = []
    for i, room in enumerate(rooms):
        receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], room)
        receiver.init()
        receiver.send_metadata(list(range(8 * i, 8 * i + 8)), i)
        receivers.append(receiver)
    assert wait_until(lambda: all(r.poll() == KVPoll.Transferring for r in receivers), 10)
    prefill.kill9()
    killed_at = time.monotonic()
    poll_until_final(receivers, timeout_s=10)
    elapsed = time.monotonic() - killed_at
    assert elapsed < DEAD_PEER_BOUND_S, f"receivers failed {elapsed:.2f}s after the kill"
    for receiver in receivers:
        assert isinstance(receiver.failure_exception(), KVPeerLostError), receiver.failure_exception()
        assert list(receiver.state_history) == [1, 2, 3, 0]
        receiver.clear()
    # Their pages were fenced (writes were in flight); nothing listens at the dead prefill's control
    # endpoint any more, so it is known gone and the fences lift without waiting for the deadline.
    assert wait_until(lambda: all(r.no_write_can_land() for r in receivers), DEAD_PEER_BOUND_S + 2)
    assert decode.mgr.stats()["fences"] == 0

    restarted = spawn_peer({"role": "prefill", "seed": 8, "bootstrap_port": port})
    assert restarted.ready["bootstrap"] == prefill.ready["bootstrap"]
    restarted.command("send", rooms=[{"room": 105, "pages": [3, 4], "aux_index": 0}])
    receiver = KVReceiver(decode.mgr, restarted.ready["bootstrap"], 105)
    receiver.init()
    receiver.send_metadata([60, 61], 0)
    poll_until_final([receiver], timeout_s=10)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert torch.equal(decode.pool[:, :, [60, 61]], fill_pool(DIMS, 8)[:, :, [3, 4]])
    assert restarted.result(10)["rooms"]["105"]["state"] == KVPoll.Success
    receiver.clear()


@pytest.mark.slow
def test_kill9_receiver_mid_transfer_fails_senders_within_heartbeat_bound(bootstrap, spawn_peer, make_rank):
    prefill = make_rank(seed=9)
    prefill.mgr.publish_layout(bootstrap.address)
    decode = spawn_peer({"role": "decode", "seed": 0})
    rooms = [201, 202, 203]
    decode.command("recv", bootstrap=bootstrap.address,
                   rooms=[{"room": room, "pages": [2 * i, 2 * i + 1], "aux_index": i} for i, room in enumerate(rooms)])
    senders = []
    for room in rooms:
        sender = KVSender(prefill.mgr, bootstrap.address, room)
        sender.init(2, 0)
        sender.send([room % 100], False)  # first chunk only: the second never comes before the kill
        senders.append(sender)
    assert wait_until(lambda: all(s.poll() == KVPoll.Transferring for s in senders), 10)
    time.sleep(0.3)  # let the first chunks land: nothing is in flight, only heartbeats can tell
    decode.kill9()
    killed_at = time.monotonic()
    poll_until_final(senders, timeout_s=10)
    elapsed = time.monotonic() - killed_at
    assert elapsed < DEAD_PEER_BOUND_S, f"senders failed {elapsed:.2f}s after the kill"
    for sender in senders:
        assert isinstance(sender.failure_exception(), KVPeerLostError), sender.failure_exception()
        assert list(sender.state_history) == [1, 2, 3, 0]
        sender.clear()


def test_abort_from_a_receiver_process_reaches_the_sender(bootstrap, spawn_peer, make_rank):
    prefill = make_rank(seed=10)
    prefill.mgr.publish_layout(bootstrap.address)
    decode = spawn_peer({"role": "decode", "seed": 0, "transfer": {"transfer_waiting_timeout_s": 0.5}})
    decode.command("recv", bootstrap=bootstrap.address, rooms=[{"room": 301, "pages": [1], "aux_index": 0}])
    sender = KVSender(prefill.mgr, bootstrap.address, 301)
    sender.init(1, 0)  # never sends: the decode side times out waiting and tells the sender
    poll_until_final([sender], timeout_s=10)
    assert "timed out" in str(sender.failure_exception())
    report = decode.result(10)["rooms"]["301"]
    assert report["error"] == "KVTimeoutError" and report["history"] == [1, 2, 0]
    sender.clear()


@pytest.mark.slow
def test_a_prefill_restarted_while_no_room_was_open_is_looked_up_afresh_not_from_a_stale_cache(
        spawn_peer, make_rank):
    """The restart happens while the decode has no room with the prefill (no heartbeat sees it):
    the decode must not reuse the old process's layout (its control endpoint and instance)."""
    port = free_port()
    prefill = spawn_peer({"role": "prefill", "seed": 7, "bootstrap_port": port})
    decode = make_rank()
    prefill.command("send", rooms=[{"room": 401, "pages": [1, 2], "aux_index": 0}])
    receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], 401)
    receiver.init()
    receiver.send_metadata([10, 11], 0)
    poll_until_final([receiver], timeout_s=10)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    receiver.clear()
    assert prefill.result(10)["rooms"]["401"]["state"] == KVPoll.Success
    # Idle: the decode stops watching the prefill, so nothing would notice its restart.
    assert wait_until(lambda: decode.mgr.stats()["watched_peers"] == 0, 10), decode.mgr.stats()
    prefill.kill9()
    restarted = spawn_peer({"role": "prefill", "seed": 8, "bootstrap_port": port})
    assert restarted.ready["bootstrap"] == prefill.ready["bootstrap"]
    assert restarted.ready["control"] != prefill.ready["control"]  # the old endpoint is dead
    restarted.command("send", rooms=[{"room": 402, "pages": [3, 4], "aux_index": 0}])
    started = time.monotonic()
    receiver = KVReceiver(decode.mgr, restarted.ready["bootstrap"], 402)
    receiver.init()
    receiver.send_metadata([60, 61], 0)
    poll_until_final([receiver], timeout_s=10)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert time.monotonic() - started < DEAD_PEER_BOUND_S
    assert torch.equal(decode.pool[:, :, [60, 61]], fill_pool(DIMS, 8)[:, :, [3, 4]])
    assert restarted.result(10)["rooms"]["402"]["state"] == KVPoll.Success
    receiver.clear()
