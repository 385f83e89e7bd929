"""The API server's ops to its engine core process, on the event loop, without ever blocking it.

Ops queued in one loop turn go to the core in one message. The socket is a bound PUSH: while no core is
connected (it died, and the reader thread has not noticed yet, or it never read again) a blocking send would
wait for a peer forever, holding the event loop and with it every request, /health and the failure that the
reader thread schedules onto it. So a send that would block keeps its ops, in order, and tries again shortly;
once the core is known to be gone they are dropped (the requests they belong to fail with the reason).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from splitserve.api.core_protocol import pack

RETRY_S = 0.01  # a core that is alive takes its messages within a loop turn; this is only for one that is not


class CoreOps:
    """Queues ops for the core and sends them, one message a loop turn, never blocking the loop; `gone()`: the
    core is known to be gone (its ops are dropped)."""

    def __init__(self, socket: zmq.Socket, gone: Callable[[], bool], retry_s: float = RETRY_S) -> None:
        self._socket = socket
        self._gone = gone
        self._retry_s = retry_s
        self._queued: list[list[Any]] = []
        self.retries = 0  # sends that would have blocked

    def send(self, op: list[Any]) -> None:
        """Queues `op`; everything queued in this loop turn goes in one message (on the running loop)."""
        self._queued.append(op)
        if len(self._queued) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def pending(self) -> int:
        """Ops queued and not sent yet."""
        return len(self._queued)

    def _flush(self) -> None:
        ops, self._queued = self._queued, []
        if not ops or self._gone():
            return
        try:
            self._socket.send(pack(ops), zmq.NOBLOCK)
        except zmq.Again:  # no core connected (or it stopped reading): keep them, in order, and try again
            self.retries += 1
            self._queued = ops + self._queued
            asyncio.get_running_loop().call_later(self._retry_s, self._flush)
