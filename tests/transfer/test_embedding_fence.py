"""Embedding slot fences with a real frozen encoder: Mooncake TCP on loopback, an encoder process
stopped with SIGSTOP halfway through writing an item (``pause_halfway_s``) for longer than the
heartbeat timeout, then resumed with SIGCONT.

The prefill fails the item when the encoder goes silent, but the encoder's second half is still
due when it resumes. The item's slot stays fenced until the encoder acknowledges the abort (after
it resumed) or the item's write-by deadline plus grace passes (a resumed encoder starts no write
past it); meanwhile other items from a healthy encoder land in the other slot, byte-exact, and
after the fence lifts in the fenced one: no byte of the frozen encoder may land in either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import TransferConfig
from splitserve.transfer.embedding.receiver import FAILED, LANDED, RECEIVING, EmbeddingReceiver, WantedItem
from splitserve.transfer.embedding.sender import EmbeddingChunk, EmbeddingSender
from splitserve.transfer.embedding.slots import EmbeddingSlots

from .conftest import readable, wait_until
from .embedding_encoder_peer import item_rows

ROWS, HIDDEN, SEED = 16, 64, 5
HALF = ROWS // 2  # the rows the frozen encoder wrote before it froze
PAUSE_S = 1.5  # halfway through its item the encoder pauses this long (and is frozen during it)
CONFIG = TransferConfig(transfer_heartbeat_interval_s=0.2, transfer_heartbeat_misses=3,
                        transfer_bootstrap_timeout_s=10.0)
PEER_SCRIPT = Path(__file__).with_name("embedding_encoder_peer.py")
IDLE = {"staged": 0, "rooms": 0, "watched_peers": 0, "fence_checks": 0, "free": 2, "fenced": 0, "leased": 0}


class Encoder:
    """``embedding_encoder_peer.py`` in a subprocess."""

    def __init__(self, room: int) -> None:
        cfg = {"rooms": [room], "rows": ROWS, "hidden": HIDDEN, "seed": SEED, "pause_s": PAUSE_S,
               "transfer": {"transfer_heartbeat_interval_s": 0.2, "transfer_heartbeat_misses": 3,
                            "transfer_bootstrap_timeout_s": 10.0}}
        self.proc = subprocess.Popen([sys.executable, "-P", str(PEER_SCRIPT), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"})
        self.endpoint = self.line(60)["endpoint"]

    def line(self, timeout_s: float) -> dict:
        assert readable(self.proc.stdout, timeout_s), "the encoder process said nothing"
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def healthy():
    sender = EmbeddingSender(CONFIG, EmbeddingSlots(4, ROWS, HIDDEN, torch.float32), CollectorRegistry())
    yield sender
    sender.close()


def wait_code(receiver: EmbeddingReceiver, rid: str, timeout_s: float = 5.0) -> int:
    assert wait_until(lambda: receiver.poll().get(rid) != RECEIVING, timeout_s), f"{rid} still receiving"
    return receiver.poll()[rid]


def land(receiver: EmbeddingReceiver, sender: EmbeddingSender, room: int,
         release: bool = True) -> tuple[int, torch.Tensor]:
    """One item from the healthy encoder; its slot and rows (checked byte-exact)."""
    data = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(room))
    src = room % 4
    sender.slots.buffer[src] = data
    assert sender.begin(room)
    sender.send(EmbeddingChunk(room, src, ROWS, HIDDEN, "float32", ROWS * HIDDEN * 4))
    receiver.stage(f"r{room}", [WantedItem(room, sender.endpoint, ROWS, "h")])
    assert wait_code(receiver, f"r{room}") == LANDED
    (_, (slot,)), = receiver.settle({f"r{room}": LANDED})[0]
    assert torch.equal(receiver.slots.rows(slot, ROWS), data)
    if release:
        receiver.release([slot])
    return slot, data


def freeze_mid_write(encoder: Encoder, receiver: EmbeddingReceiver, room: int) -> float:
    """Stages the encoder's item, stops the encoder once half its rows landed; the item fails."""
    receiver.stage("frozen", [WantedItem(room, encoder.endpoint, ROWS, "f")])
    expected = item_rows(SEED, room, ROWS, HIDDEN)
    assert wait_until(lambda: torch.equal(receiver.slots.buffer[0, :HALF], expected[:HALF]), 20)
    encoder.proc.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    assert torch.count_nonzero(receiver.slots.buffer[0, HALF:]) == 0  # frozen mid-write
    assert wait_code(receiver, "frozen", 3 * CONFIG.heartbeat_timeout_s) == FAILED
    (_, reason), = receiver.settle({"frozen": FAILED})[1]
    assert "stopped answering" in reason
    assert receiver.stats()["fenced"] == 1
    return frozen_at


@pytest.mark.slow
def test_a_frozen_encoder_s_slot_stays_fenced_until_it_resumes_and_acknowledges(healthy) -> None:
    receiver = EmbeddingReceiver(CONFIG, EmbeddingSlots(2, ROWS, HIDDEN, torch.float32), timeout_s=30.0,
                                 metrics_registry=CollectorRegistry())
    encoder = Encoder(801)
    try:
        frozen_at = freeze_mid_write(encoder, receiver, 801)
        # Other requests reuse the free slot, one after the other; the fenced one is not given out.
        assert land(receiver, healthy, 811)[0] == 1
        kept_slot, kept = land(receiver, healthy, 812, release=False)
        assert kept_slot == 1
        healthy.begin(813)
        receiver.stage("waits", [WantedItem(813, healthy.endpoint, ROWS, "w")])
        time.sleep(max(0.0, frozen_at + 4 * CONFIG.heartbeat_timeout_s - time.monotonic()))
        assert receiver.poll()["waits"] == RECEIVING  # no slot: slot 0 is still fenced
        assert receiver.stats()["fenced"] == 1, "the fence lifted while the encoder was frozen"
        # Resumed: the encoder answers the repeated abort once its write returned or was refused.
        encoder.proc.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        assert wait_until(lambda: receiver.stats()["fenced"] == 0, 5), receiver.stats()
        lifted_s = time.monotonic() - resumed_at
        assert receiver.metrics.fences_total.labels(outcome="acknowledged")._value.get() == 1
        assert encoder.line(5)["concluded"] == 801
        # The waiting item now gets slot 0 and lands exactly; nothing of the frozen encoder lands after.
        data = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(813))
        healthy.slots.buffer[1] = data
        healthy.send(EmbeddingChunk(813, 1, ROWS, HIDDEN, "float32", ROWS * HIDDEN * 4))
        assert wait_code(receiver, "waits") == LANDED
        (_, (slot,)), = receiver.settle({"waits": LANDED})[0]
        time.sleep(0.3)
        assert slot == 0 and torch.equal(receiver.slots.rows(0, ROWS), data)
        assert torch.equal(receiver.slots.rows(kept_slot, ROWS), kept)
        receiver.release([slot, kept_slot])
        assert receiver.stats() == IDLE
        assert receiver.metrics.slots_fenced._value.get() == 0
        print(f"fence lifted {lifted_s * 1000:.0f} ms after SIGCONT")
    finally:
        encoder.close()
        receiver.close()


@pytest.mark.slow
def test_a_fence_lifts_at_the_write_by_deadline_and_the_resumed_encoder_writes_nothing(healthy) -> None:
    config = CONFIG.replace(transfer_fence_grace_s=0.5)
    receiver = EmbeddingReceiver(config, EmbeddingSlots(2, ROWS, HIDDEN, torch.float32), timeout_s=1.0,
                                 metrics_registry=CollectorRegistry())
    encoder = Encoder(901)
    try:
        freeze_mid_write(encoder, receiver, 901)
        # Still frozen past the write-by deadline (staging + 1 s) plus grace: the fence lifts.
        assert wait_until(lambda: receiver.stats()["fenced"] == 0, 5), receiver.stats()
        assert receiver.metrics.fences_total.labels(outcome="deadline")._value.get() == 1
        slot0, _ = land(receiver, healthy, 911, release=False)
        slot1, _ = land(receiver, healthy, 912, release=False)
        assert {slot0, slot1} == {0, 1}
        copies = {s: receiver.slots.rows(s, ROWS).clone() for s in (0, 1)}
        encoder.proc.send_signal(signal.SIGCONT)
        done = encoder.line(5)
        assert done["concluded"] == 901 and not done["ok"], done  # its second half was refused
        time.sleep(0.3)
        for s, rows in copies.items():
            assert torch.equal(receiver.slots.rows(s, ROWS), rows), f"the resumed encoder wrote into slot {s}"
        receiver.release([0, 1])
        assert receiver.stats() == IDLE
    finally:
        encoder.close()
        receiver.close()
