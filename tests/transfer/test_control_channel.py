"""The control channel's thread: a queued send wakes it at once, whatever sends raced with its last wake-up."""

from __future__ import annotations

import threading
import time
from typing import Any

from splitserve.transfer.control_channel import ControlChannel
from splitserve.transfer.control_messages import ControlMessage, Ping, encode_message

KEY = b"k" * 32
TICK_S = 5.0  # far longer than any wait below: a queued send that waits for a tick fails the test


class Arrivals:
    """The Pings a channel received, by seq."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self._changed = threading.Condition()

    def add(self, msg: ControlMessage) -> None:
        assert isinstance(msg, Ping)
        with self._changed:
            self.seqs.append(msg.seq)
            self._changed.notify_all()

    def wait_for(self, seq: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: seq in self.seqs, timeout)


def channel(on_message=lambda _msg: None) -> ControlChannel:
    return ControlChannel("127.0.0.1", 0, KEY, on_message=on_message, on_tick=lambda _now: None, tick_s=TICK_S)


def ping(seq: int) -> Ping:
    return Ping(reply_to="tcp://127.0.0.1:1", instance="test", seq=seq)


class WakeDuringDrain:
    """The channel's wake-up socket, but the first drain first runs `during` (on the channel's thread): as if
    another thread queued a send and woke the channel between its wake-up and the end of that drain."""

    def __init__(self, wake_r: Any, during) -> None:
        self._wake_r, self._during = wake_r, during

    def recv(self, size: int) -> bytes:
        during, self._during = self._during, None
        if during is not None:
            during()
        return self._wake_r.recv(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wake_r, name)


def test_a_send_queued_after_a_wake_up_raced_with_the_drain_still_wakes_the_thread() -> None:
    first, second = Arrivals(), Arrivals()
    receiver, other_receiver = channel(first.add), channel(second.add)
    sender = channel()
    try:
        def queue_and_wake() -> None:  # what another thread's send does when it finds no socket yet
            sender._outbox.append((receiver.endpoint, encode_message(ping(1), KEY)))
            sender._wake()

        sender._wake_r = WakeDuringDrain(sender._wake_r, queue_and_wake)
        sender.send(receiver.endpoint, ping(0))  # no socket to it yet: queued, wakes the thread
        assert first.wait_for(0, 2) and first.wait_for(1, 2)
        started = time.monotonic()
        sender.send(other_receiver.endpoint, ping(2))  # no socket yet either: queued again
        assert second.wait_for(2, 2), "the queued send waited for the channel's next tick"
        assert time.monotonic() - started < 1.0
    finally:
        for c in (sender, receiver, other_receiver):
            c.close()


def test_sends_from_one_thread_arrive_in_order_whether_sent_directly_or_queued() -> None:
    arrivals = Arrivals()
    receiver, sender = channel(arrivals.add), channel()
    try:
        for seq in range(300):  # the first ones queue (no socket yet), later ones go out on the caller's thread
            sender.send(receiver.endpoint, ping(seq))
        assert arrivals.wait_for(299, 5)
        assert arrivals.seqs == list(range(300))
    finally:
        sender.close()
        receiver.close()
