"""Write fences with a real frozen prefill: Mooncake TCP on loopback, a prefill process stopped
with SIGSTOP mid-transfer for longer than the heartbeat timeout, then resumed with SIGCONT.

The decode fails the room when the prefill goes silent, but the prefill's next chunk is still due
when it resumes. The failed room's pages stay fenced until the prefill acknowledges (after it
resumed) or its write-by deadline plus grace passes; a resumed prefill starts no write past the
deadline. The pages are then reused by a room from a healthy prefill: no byte of the frozen one
may land in them afterwards, nor in any other room's pages.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from splitserve.transfer import KVPeerLostError, KVPoll, KVReceiver, KVSender

from .conftest import FAST, HEARTBEAT_MISSES, HEARTBEAT_S, SHAPE, fill_pool, poll_until_final, wait_until

DIMS = (SHAPE["layers"], 2, SHAPE["pages"], SHAPE["page_size"], SHAPE["heads"], SHAPE["head_dim"])
FROZEN_SRC = list(range(0, 16))
FENCED = list(range(32, 48))  # the frozen room's decode pages, reused after the fence
OTHER = list(range(64, 68))  # another room's pages, written while the prefill is frozen
# The frozen room's second chunk is due this long after its first: the test must stop the prefill within it
# (it stays frozen for 2 s and more, so the chunk is overdue when it resumes).
CHUNK_DELAY_S = 1.2


def frozen_room_sender(prefill, bootstrap_addr: str, room: int) -> None:
    prefill.command("send", rooms=[{"room": room, "pages": FROZEN_SRC, "aux_index": 0, "chunks": [4, 12],
                                    "chunk_delay": CHUNK_DELAY_S}])


def freeze_after_first_chunk(prefill, decode, receiver: KVReceiver) -> float:
    """Stops the prefill once its first chunk landed and before its second is due."""
    frozen_src = fill_pool(DIMS, 7)
    assert wait_until(lambda: torch.equal(decode.pool[:, :, FENCED[:4]], frozen_src[:, :, FROZEN_SRC[:4]]), 10)
    first_landed = time.monotonic()
    prefill.proc.send_signal(signal.SIGSTOP)
    assert not torch.equal(decode.pool[:, :, FENCED[4:]], frozen_src[:, :, FROZEN_SRC[4:]]), (
        f"the prefill was stopped {time.monotonic() - first_landed:.2f} s after its first chunk landed, after its "
        "second: nothing left to fence (the test process was starved of CPU)")
    frozen_at = time.monotonic()
    poll_until_final([receiver], timeout_s=10)
    assert isinstance(receiver.failure_exception(), KVPeerLostError), receiver.failure_exception()
    return frozen_at


def reuse(healthy, decode, bootstrap_addr: str, room: int, src: list[int], dst: list[int]) -> None:
    """One whole room from the healthy in-process prefill into ``dst``."""
    sender = KVSender(healthy.mgr, bootstrap_addr, room)
    receiver = KVReceiver(decode.mgr, bootstrap_addr, room)
    receiver.init()
    receiver.send_metadata(dst, 5)
    sender.init(len(src), 5)
    sender.send(src, last_chunk=True)
    poll_until_final([sender, receiver], timeout_s=10)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert receiver.no_write_can_land()
    sender.clear()
    receiver.clear()


@pytest.mark.slow
def test_a_frozen_prefill_s_pages_stay_fenced_until_it_resumes_and_acknowledges(bootstrap, spawn_peer, make_rank):
    prefill = spawn_peer({"role": "prefill", "seed": 7})
    healthy = make_rank(seed=2)
    healthy.mgr.publish_layout(bootstrap.address)
    decode = make_rank()
    frozen_room_sender(prefill, prefill.ready["bootstrap"], 501)
    receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], 501)
    receiver.init()
    receiver.send_metadata(FENCED, 0)
    frozen_at = freeze_after_first_chunk(prefill, decode, receiver)
    try:
        receiver.clear()
        # Frozen far past the heartbeat timeout: the room failed, its pages are still fenced.
        reuse(healthy, decode, bootstrap.address, 502, [90, 91, 92, 93], OTHER)
        other_bytes = decode.pool[:, :, OTHER].clone()
        time.sleep(max(0.0, frozen_at + 4 * HEARTBEAT_S * HEARTBEAT_MISSES - time.monotonic()))
        assert not receiver.no_write_can_land(), "the fence lifted while the prefill was frozen"
        assert decode.mgr.stats()["fences"] == 1
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    # Resumed, the prefill learns the room is dead, stops, and says so: the fence lifts.
    assert wait_until(receiver.no_write_can_land, 5), "the resumed prefill never acknowledged"
    print(f"fence lifted {time.monotonic() - resumed_at:.2f}s after SIGCONT "
          f"({resumed_at - frozen_at:.1f}s frozen)")
    assert decode.mgr.stats()["fences"] == 0
    report = prefill.result(10)["rooms"]["501"]
    # On SIGCONT two threads of the prefill race: its control thread reads the decode's abort (sent while it was
    # frozen) and its worker starts the overdue chunk. Either may win: the room ends Failed, or the chunk is
    # written first and the room ends Success. A Success is only honest if that chunk landed, while the fence held.
    assert report["state"] in (KVPoll.Failed, KVPoll.Success), report
    if report["state"] == KVPoll.Success:
        frozen_src = fill_pool(DIMS, 7)
        assert torch.equal(decode.pool[:, :, FENCED], frozen_src[:, :, FROZEN_SRC]), "Success, yet not written"
    reuse(healthy, decode, bootstrap.address, 503, list(range(100, 116)), FENCED)
    time.sleep(1.0)  # any write of the resumed prefill still to come would land by now
    assert torch.equal(decode.pool[:, :, FENCED], healthy.pool[:, :, list(range(100, 116))])
    assert torch.equal(decode.pool[:, :, OTHER], other_bytes)


@pytest.mark.slow
def test_a_prefill_resumed_past_its_write_by_deadline_starts_no_write(bootstrap, spawn_peer, make_rank):
    """Frozen past the deadline: the fence lifts by itself (deadline + grace) while the prefill is
    still frozen, and the resumed prefill, whose second chunk is overdue, writes nothing."""
    window_s, grace_s = 2.0, 0.5
    prefill = spawn_peer({"role": "prefill", "seed": 7})
    healthy = make_rank(seed=2)
    healthy.mgr.publish_layout(bootstrap.address)
    decode = make_rank(config=FAST.replace(transfer_write_window_s=window_s, transfer_fence_grace_s=grace_s))
    frozen_room_sender(prefill, prefill.ready["bootstrap"], 601)
    receiver = KVReceiver(decode.mgr, prefill.ready["bootstrap"], 601)
    receiver.init()
    receiver.send_metadata(FENCED, 0)
    sent_at = time.monotonic()
    freeze_after_first_chunk(prefill, decode, receiver)
    try:
        receiver.clear()
        assert not receiver.no_write_can_land()
        assert wait_until(receiver.no_write_can_land, window_s + grace_s + 2)
        lifted_after = time.monotonic() - sent_at
        assert lifted_after >= window_s + grace_s, f"lifted {lifted_after:.2f}s after the metadata"
        assert decode.mgr.stats()["fences"] == 0
        reuse(healthy, decode, bootstrap.address, 602, list(range(100, 116)), FENCED)
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    report = prefill.result(10)["rooms"]["601"]
    assert report["state"] == KVPoll.Failed
    time.sleep(1.0)
    assert torch.equal(decode.pool[:, :, FENCED], healthy.pool[:, :, list(range(100, 116))])


def test_an_aborted_room_s_fence_lifts_once_the_prefill_answers(bootstrap, make_rank):
    """The common case: a room aborted mid-transfer is fenced for one round trip, not a timeout."""
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    sender = KVSender(prefill.mgr, bootstrap.address, 701)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 701)
    receiver.init()
    receiver.send_metadata([1, 2], 0)
    sender.init(2, 0)
    sender.send([5], last_chunk=False)
    assert wait_until(lambda: receiver.poll() == KVPoll.Transferring, 5)
    receiver.abort("client left")
    assert wait_until(receiver.no_write_can_land, 2.0)
    assert decode.mgr.stats()["fences"] == 0 and prefill.mgr.stats()["writes_in_flight"] == 0
    poll_until_final([sender], timeout_s=5)
    sender.clear()
    receiver.clear()
