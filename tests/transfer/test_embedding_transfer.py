"""Embedding rows from an encoder's sender to a prefill's receiver over real Mooncake TCP on loopback: exact
bytes, checks before any write, failures on both sides, slots fenced until the encoder answers, counts back to start."""

from __future__ import annotations

import os
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import pytest
import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import TransferConfig
from splitserve.transfer.embedding.receiver import FAILED, LANDED, RECEIVING, EmbeddingReceiver, WantedItem
from splitserve.transfer.embedding.sender import EmbeddingChunk, EmbeddingSender
from splitserve.transfer.embedding.slots import EmbeddingSlots

from .conftest import wait_until

ROWS, HIDDEN = 16, 64
CONFIG = TransferConfig(transfer_heartbeat_interval_s=0.2, transfer_heartbeat_misses=3,
                        transfer_bootstrap_timeout_s=5.0)

IDLE_3 = {"staged": 0, "rooms": 0, "watched_peers": 0, "fence_checks": 0, "free": 3, "fenced": 0, "leased": 0}
SENDER_IDLE = {"rooms": 0, "early": 0, "concluded": 0, "writing": 0, "partly_written": 0, "writes_in_flight": 0}


@pytest.fixture
def pair():
    enc_slots = EmbeddingSlots(4, ROWS, HIDDEN, torch.float32)
    pre_slots = EmbeddingSlots(3, ROWS, HIDDEN, torch.float32)
    sender = EmbeddingSender(CONFIG, enc_slots, CollectorRegistry())
    receiver = EmbeddingReceiver(CONFIG, pre_slots, timeout_s=3.0, metrics_registry=CollectorRegistry())
    yield sender, receiver
    receiver.close()
    sender.close()


def wait_codes(receiver: EmbeddingReceiver, rid: str, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = receiver.poll().get(rid)
        if code != RECEIVING:
            return code  # type: ignore[return-value]
        time.sleep(0.01)
    raise AssertionError(f"{rid} still receiving after {timeout} s")


def put_rows(sender: EmbeddingSender, slot: int, seed: int, rows: int = ROWS) -> torch.Tensor:
    data = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    sender.slots.buffer[slot, :rows] = data
    return data


def chunk(room: int, slot: int, rows: int = ROWS, hidden: int = HIDDEN, dtype: str = "float32") -> EmbeddingChunk:
    return EmbeddingChunk(room, slot, rows, hidden, dtype, rows * hidden * 4)


def test_rows_land_exactly_whichever_side_comes_first(pair) -> None:
    sender, receiver = pair
    a, b = put_rows(sender, 0, 1), put_rows(sender, 1, 2)
    assert sender.begin(11) and not sender.begin(11)  # a room is taken once
    assert sender.begin_all([13, 11]) == 11 and sender.stats()["rooms"] == 1  # all or none: 13 was not opened
    sender.send(chunk(11, 0))  # rows ready before the prefill asks
    receiver.stage("r", [WantedItem(11, sender.endpoint, ROWS, "a" * 64),
                         WantedItem(12, sender.endpoint, ROWS, "b" * 64)])
    time.sleep(0.2)
    assert receiver.poll()["r"] == RECEIVING  # room 12's image has not reached the encoder yet
    assert sender.begin_all([12, 12]) == 12 and sender.stats()["early"] == 1  # refused whole: the ask still waits
    assert sender.begin(12)  # the prefill's ask for 12 arrived first and waited
    sender.send(chunk(12, 1))
    assert wait_codes(receiver, "r") == LANDED
    landed, failed = receiver.settle({"r": LANDED})
    assert failed == [] and [rid for rid, _ in landed] == ["r"]
    slots = landed[0][1]
    assert torch.equal(receiver.slots.rows(slots[0], ROWS), a) and torch.equal(receiver.slots.rows(slots[1], ROWS), b)
    receiver.release(slots)
    assert sorted(c.room for c in sender.concluded()) == [11, 12]
    assert receiver.stats() == IDLE_3
    assert sender.stats() == SENDER_IDLE


@pytest.mark.parametrize("bad", ["rows", "hidden", "dtype"])
def test_a_mismatch_fails_both_sides_and_writes_nothing(pair, bad: str) -> None:
    sender, receiver = pair
    put_rows(sender, 0, 3)
    sender.begin(21)
    wrong = {"rows": chunk(21, 0, rows=ROWS - 1), "hidden": chunk(21, 0, hidden=HIDDEN // 2),
             "dtype": chunk(21, 0, dtype="bfloat16")}[bad]
    sender.send(wrong)
    receiver.stage("r", [WantedItem(21, sender.endpoint, ROWS, "c" * 64)])
    assert wait_codes(receiver, "r") == FAILED
    landed, failed = receiver.settle({"r": FAILED})
    assert landed == [] and "mismatch" in failed[0][1]
    assert torch.count_nonzero(receiver.slots.buffer) == 0  # nothing was written
    (done,) = sender.concluded()
    assert not done.ok and "mismatch" in done.reason
    assert receiver.stats()["fenced"] == 1  # fenced until the encoder answers the abort, then free again
    assert wait_until(lambda: receiver.stats()["free"] == 3, 2)


def test_a_dead_encoder_fails_its_items_within_the_heartbeat_bound(pair) -> None:
    _, receiver = pair
    other = EmbeddingSender(CONFIG, EmbeddingSlots(1, ROWS, HIDDEN, torch.float32), CollectorRegistry())
    endpoint = other.endpoint
    other.close()  # its control channel is gone: no pong ever comes back
    started = time.monotonic()
    receiver.stage("r", [WantedItem(31, endpoint, ROWS, "d" * 64)])
    assert wait_codes(receiver, "r", timeout=3) == FAILED
    assert time.monotonic() - started < CONFIG.heartbeat_timeout_s + 0.5
    _, failed = receiver.settle({"r": FAILED})
    assert "stopped answering" in failed[0][1]
    assert receiver.stats()["fenced"] == 1  # until the encoder is known gone: nothing listens at its endpoint
    assert wait_until(lambda: receiver.stats() == IDLE_3, CONFIG.heartbeat_timeout_s + 2), receiver.stats()
    assert receiver.metrics.fences_total.labels(outcome="peer gone")._value.get() == 1


def test_closing_a_failed_call_closes_its_own_open_rooms_only(pair) -> None:
    """/v1/encode's failure path: the call's rooms close at once (the prefill that already asked is
    told it failed), another call's room with them stays open."""
    sender, receiver = pair
    receiver.stage("asked", [WantedItem(52, sender.endpoint, ROWS, "f" * 64)])
    assert wait_until(lambda: sender.stats()["early"] == 1, 2)  # the prefill asked before the call came
    assert sender.begin_all([51, 52], owner=1) is None and sender.begin_all([53], owner=2) is None
    assert sender.close_rooms(2, [51, 52], "not call 2's") == [] and sender.stats()["rooms"] == 3
    assert sender.close_rooms(1, [51, 52, 99], "its call failed") == [51, 52]
    assert sender.stats() == {**SENDER_IDLE, "rooms": 1, "concluded": 2}  # 53 (call 2's) is still open
    assert wait_codes(receiver, "asked") == FAILED
    _, failed = receiver.settle({"asked": FAILED})
    assert "its call failed" in failed[0][1]
    assert sorted((c.room, c.ok) for c in sender.concluded()) == [(51, False), (52, False)]
    assert sender.send(chunk(51, 0)) is False  # a job of the closed call that ran anyway: its slot is the caller's
    assert wait_until(lambda: receiver.stats() == IDLE_3, 2), receiver.stats()


def test_timeout_and_drop_tell_the_encoder_and_free_everything(pair) -> None:
    sender, _ = pair
    quick = EmbeddingReceiver(CONFIG, EmbeddingSlots(2, ROWS, HIDDEN, torch.float32), timeout_s=0.4,
                              metrics_registry=CollectorRegistry())
    try:
        sender.begin(41)  # never sends its rows (the image is slow)
        quick.stage("slow", [WantedItem(41, sender.endpoint, ROWS, "e" * 64)])
        assert wait_codes(quick, "slow", timeout=2) == FAILED
        _, failed = quick.settle({"slow": FAILED})
        assert "timed out" in failed[0][1]
        deadline = time.monotonic() + 2
        while sender.stats()["rooms"] != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        (done,) = sender.concluded()
        assert done.room == 41 and not done.ok and "aborted by the prefill" in done.reason
        # A request dropped mid-way (client gone): the same.
        sender.begin(42)
        quick.stage("gone", [WantedItem(42, sender.endpoint, ROWS, "f" * 64)])
        time.sleep(0.1)
        quick.drop("gone", "client disconnected")
        assert wait_until(lambda: quick.stats() == {**IDLE_3, "free": 2}, 2), quick.stats()  # the encoder answered
        assert [c.room for c in sender.concluded()] == [42]
        assert quick.metrics.fences_total.labels(outcome="acknowledged")._value.get() == 2
        assert sender.stats() == SENDER_IDLE
    finally:
        quick.close()


def test_more_items_than_slots_wait_for_a_slot(pair) -> None:
    sender, receiver = pair
    items = [WantedItem(50 + i, sender.endpoint, ROWS, f"{i:064x}") for i in range(4)]  # 4 items, 3 slots
    receiver.stage("big", items[:3])
    receiver.stage("next", items[3:])
    for i in range(4):
        put_rows(sender, i, 10 + i)
        sender.begin(50 + i)
        sender.send(chunk(50 + i, i))
    assert wait_codes(receiver, "big") == LANDED
    landed, _ = receiver.settle({"big": LANDED})
    assert receiver.poll()["next"] == RECEIVING  # no slot yet
    receiver.release(landed[0][1])
    assert wait_codes(receiver, "next") == LANDED
    landed, _ = receiver.settle({"next": LANDED})
    assert torch.equal(receiver.slots.rows(landed[0][1][0], ROWS), sender.slots.buffer[3])
    receiver.release(landed[0][1])


def test_a_fixed_embedding_control_port_from_the_env_is_where_peers_write(pair) -> None:
    """`--embedding-control-port` / SPLITSERVE_EMBEDDING_CONTROL_PORT pins the receiver's control socket
    (pods expose it); it is not the KV control port, which a prefill binds beside it."""
    import argparse

    from servers import free_port

    from splitserve.config_flags import add_config_flags, config_from_args

    sender, _ = pair
    port, kv_port = free_port(), free_port()
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TransferConfig, "SPLITSERVE")
    config = config_from_args(TransferConfig, parser.parse_args(["--transfer-control-port", str(kv_port)]),
                              "SPLITSERVE", environ={"SPLITSERVE_EMBEDDING_CONTROL_PORT": str(port)})
    config = config.replace(transfer_heartbeat_interval_s=0.2, transfer_heartbeat_misses=3)
    assert (config.embedding_control_port, config.transfer_control_port) == (port, kv_port)
    fixed = EmbeddingReceiver(config, EmbeddingSlots(1, ROWS, HIDDEN, torch.float32), timeout_s=3.0,
                              metrics_registry=CollectorRegistry())
    try:
        assert fixed.endpoint == f"tcp://127.0.0.1:{port}"
        data = put_rows(sender, 2, 9)
        assert sender.begin(31)
        fixed.stage("r", [WantedItem(31, sender.endpoint, ROWS, "d")])
        sender.send(chunk(31, 2))
        assert wait_codes(fixed, "r") == LANDED
        (rid, slots), = fixed.settle({"r": LANDED})[0]
        assert rid == "r"
        assert torch.equal(fixed.slots.rows(slots[0], ROWS), data)
        fixed.release(slots)
    finally:
        fixed.close()
