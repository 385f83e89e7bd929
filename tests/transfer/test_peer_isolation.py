"""A dead or stuck peer delays nobody else: real Mooncake TCP and ZeroMQ on loopback, real processes.

A decode process frozen with SIGSTOP mid-transfer makes the prefill's Mooncake write to it
block; a room to a healthy decode must not wait behind it. A bootstrap server that accepts
connections and never answers makes its lookup hang; a lookup at a healthy one must not wait
behind it.

Mooncake 0.3.13's Python binding runs the first handshake with a peer under a mutex of its
engine (every write of that engine takes it too), and the handshake's socket read times out only
after 60 s: a peer frozen in it would stall every write of a shared engine for a minute. The sender
writes to each peer through an engine of its own (peer_engines.py), so it stalls only its own.
"""

from __future__ import annotations

import signal
import socket
import sys
import time

import pytest
import torch

from splitserve.transfer import KVMetadataError, KVPoll, KVReceiver, KVSender
from splitserve.transfer.kv.manager import LOOKUP_UNREACHABLE_S

from .conftest import FAST, poll_until_final, transfer_once, wait_until

# A room to a healthy peer on loopback takes a few ms; this is the bound under a 2-core CI load.
HEALTHY_ROOM_BOUND_S = 2.0


def frame_of(thread_prefix: str) -> str | None:
    """The function a thread (by name prefix) is running now, or None if no such thread."""
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith(thread_prefix):
            frame = sys._current_frames().get(thread.ident)
            return frame.f_code.co_name if frame is not None else None
    return None


@pytest.mark.slow
def test_a_frozen_peer_blocks_only_its_own_rooms_and_its_worker_ends_after(bootstrap, spawn_peer, make_rank):
    prefill = make_rank(seed=1, config=FAST.replace(transfer_threads=1))
    prefill.mgr.workers.idle_s = 0.5
    prefill.mgr.publish_layout(bootstrap.address)
    healthy = make_rank()
    frozen = spawn_peer({"role": "decode", "seed": 0})
    frozen.command("recv", bootstrap=bootstrap.address, rooms=[{"room": 3, "pages": list(range(64)),
                                                                 "aux_index": 1}])
    stuck = KVSender(prefill.mgr, bootstrap.address, 3)
    stuck.init(64, 1)
    assert wait_until(lambda: stuck.poll() == KVPoll.WaitingForInput, 10), stuck.poll()
    worker = f"transfer-worker-{frozen.ready['control']}"
    assert wait_until(lambda: True in prefill.mgr.sessions_opened.values(), 10)  # the handshake on its metadata
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        stuck.send(list(range(64)), last_chunk=True)  # more than the socket buffers hold: the write blocks
        assert wait_until(lambda: frame_of(worker) == "write", 5), frame_of(worker)
        time.sleep(0.2)
        started = time.monotonic()
        transfer_once(prefill, healthy.mgr, bootstrap.address, 4, [20, 21, 22], [10, 11, 12], aux_index=2)
        waited = time.monotonic() - started
        assert torch.equal(healthy.pool[:, :, [10, 11, 12]], prefill.pool[:, :, [20, 21, 22]])
        assert frame_of(worker) == "write", "the frozen peer's write returned: the test proves nothing"
        assert waited < HEALTHY_ROOM_BOUND_S, f"a room to a healthy peer took {waited:.2f}s"
        print(f"healthy room while a peer is frozen: {waited * 1000:.0f} ms")
        # The frozen peer stopped answering heartbeats: its room failed without waiting for the write.
        poll_until_final([stuck], timeout_s=5)
        assert stuck.poll() == KVPoll.Failed
        stuck.clear()
    finally:
        frozen.kill9()
    # Its write returns once the process is gone; then the worker idles out: back to no workers.
    assert wait_until(lambda: prefill.mgr.stats()["worker_threads"] == 0, 45), prefill.mgr.stats()


def test_a_hanging_bootstrap_server_delays_only_its_own_lookups(bootstrap, make_rank):
    prefill, decode = make_rank(seed=2), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    with socket.socket() as blackhole:  # accepts connections (the backlog) and never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        hanging = f"127.0.0.1:{blackhole.getsockname()[1]}"
        stuck = KVReceiver(decode.mgr, hanging, 3)
        stuck.init()
        stuck.send_metadata([1], 0)
        assert wait_until(lambda: decode.mgr.stats()["lookup_threads"] == 1, 2)
        time.sleep(0.2)  # the hanging lookup is in its HTTP call now
        started = time.monotonic()
        sender = KVSender(prefill.mgr, bootstrap.address, 4)
        receiver = KVReceiver(decode.mgr, bootstrap.address, 4)
        receiver.init()
        receiver.send_metadata([2, 3], 1)
        sender.init(2, 1)
        sender.send([7, 8], last_chunk=True)
        poll_until_final([sender, receiver], timeout_s=10)
        waited = time.monotonic() - started
        assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
        assert stuck.poll() == KVPoll.Bootstrapping, "the hanging lookup ended: the test proves nothing"
        assert waited < HEALTHY_ROOM_BOUND_S, f"a lookup at a healthy server took {waited:.2f}s"
        print(f"healthy lookup while another hangs: {waited * 1000:.0f} ms")
        sender.clear()
        receiver.clear()
        stuck.clear()
    assert wait_until(lambda: decode.mgr.stats()["lookup_threads"] == 0, 10), decode.mgr.stats()


def test_an_unreachable_bootstrap_address_fails_its_room_quickly_not_at_the_deadline(make_rank):
    decode = make_rank(config=FAST.replace(transfer_bootstrap_timeout_s=60.0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{s.getsockname()[1]}"  # closed again below: nothing listens there
    started = time.monotonic()
    receiver = KVReceiver(decode.mgr, refused, 5)
    receiver.init()
    receiver.send_metadata([1], 0)
    poll_until_final([receiver], timeout_s=10)
    elapsed = time.monotonic() - started
    assert isinstance(receiver.failure_exception(), KVMetadataError), receiver.failure_exception()
    assert "unreachable" in str(receiver.failure_exception())
    assert elapsed < LOOKUP_UNREACHABLE_S + 2.0, f"failed after {elapsed:.2f}s"
    receiver.clear()
    assert wait_until(lambda: decode.mgr.stats()["lookup_threads"] == 0, 5)
    assert decode.mgr.stats()["rooms"] == 0


@pytest.mark.slow
def test_a_fresh_peer_frozen_in_its_first_handshake_stalls_no_other_peer(bootstrap, spawn_peer, make_rank):
    config = FAST.replace(transfer_heartbeat_misses=50)  # the frozen peer's room stays open meanwhile
    prefill = make_rank(seed=1, config=config)
    prefill.mgr.publish_layout(bootstrap.address)
    healthy = make_rank(config=config)
    transfer_once(prefill, healthy.mgr, bootstrap.address, 1, [5, 6], [1, 2], aux_index=1)  # its session is open
    frozen = spawn_peer({"role": "decode", "seed": 0})
    frozen.command("recv", bootstrap=bootstrap.address, rooms=[{"room": 3, "pages": [1, 2], "aux_index": 3}])
    assert wait_until(lambda: prefill.mgr.stats()["early_metadata"] == 1, 10)
    frozen.proc.send_signal(signal.SIGSTOP)  # before this prefill ever spoke to its Mooncake engine
    try:
        stuck = KVSender(prefill.mgr, bootstrap.address, 3)
        stuck.init(2, 3)  # the metadata is taken in: the handshake with the frozen peer starts
        assert wait_until(lambda: False in prefill.mgr.sessions_opened.values(), 5)
        time.sleep(0.3)  # the handshake is in its socket read now (60 s before Mooncake gives up)
        started = time.monotonic()
        transfer_once(prefill, healthy.mgr, bootstrap.address, 4, [20, 21], [10, 11], aux_index=2)
        waited = time.monotonic() - started
        assert torch.equal(healthy.pool[:, :, [10, 11]], prefill.pool[:, :, [20, 21]])
        assert False in prefill.mgr.sessions_opened.values(), "the handshake ended: the test proves nothing"
        assert waited < HEALTHY_ROOM_BOUND_S, f"a room to a healthy peer took {waited:.2f}s"
        print(f"healthy room while a fresh peer's first handshake hangs: {waited * 1000:.0f} ms")
        assert prefill.mgr.stats()["writer_engines"] == 2
        stuck.abort("test over")
        stuck.clear()
    finally:
        frozen.kill9()
