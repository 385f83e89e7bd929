"""The API server's ops to its engine core never block the event loop (api/core_ops.py).

Over a real ZeroMQ PUSH socket bound as the server binds it: with no core connected (one that was just
killed, before the reader thread notices) a blocking send waits for a peer forever, and with it every
request, /health and the failure the reader thread schedules onto the loop.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from splitserve.api.core_ops import CoreOps
from splitserve.api.core_protocol import ipc_address, unpack


@pytest.fixture
def push(tmp_path: Path):
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 2000)  # a send that blocks would hold the loop this long, not forever
    address = ipc_address(str(tmp_path), "to-core")
    socket.bind(address)
    yield context, socket, address
    context.destroy(linger=0)


def test_a_blocking_send_with_no_core_connected_would_wait_forever(push) -> None:
    _, socket, _ = push
    with pytest.raises(zmq.Again):  # after the fixture's 2 s limit; without one it would wait for a peer
        socket.send(b"x")


def test_ops_with_no_core_wait_without_blocking_the_loop_and_arrive_in_order_once_one_connects(push) -> None:
    context, socket, address = push

    async def scenario() -> tuple[list, float]:
        ops = CoreOps(socket, gone=lambda: False, retry_s=0.005)
        ops.send(["add", 1])
        ops.send(["add", 2])
        started = time.monotonic()
        await asyncio.sleep(0.05)  # the loop turns: had the send blocked, this sleep would never end
        held = time.monotonic() - started
        assert ops.pending() == 2 and ops.retries >= 2
        ops.send(["abort", 1])  # queued behind them, not ahead
        core = context.socket(zmq.PULL)
        core.setsockopt(zmq.LINGER, 0)
        core.connect(address)
        try:
            deadline = time.monotonic() + 5
            while ops.pending():
                assert time.monotonic() < deadline, "the queued ops never went out"
                await asyncio.sleep(0.005)
            assert core.poll(2000)
            received = unpack(core.recv())
            while core.poll(50):
                received += unpack(core.recv())
        finally:
            core.close(linger=0)
        return received, held

    received, held = asyncio.run(scenario())
    assert held < 1.0
    assert received == [["add", 1], ["add", 2], ["abort", 1]]


def test_ops_for_a_core_known_gone_are_dropped(push) -> None:
    _, socket, _ = push
    gone = False

    async def scenario() -> CoreOps:
        nonlocal gone
        ops = CoreOps(socket, gone=lambda: gone, retry_s=0.005)
        ops.send(["add", 1])
        await asyncio.sleep(0.02)
        assert ops.pending() == 1  # waiting for a core
        gone = True  # the reader thread found the core dead: its requests fail with the reason
        await asyncio.sleep(0.02)
        return ops

    ops = asyncio.run(scenario())
    assert ops.pending() == 0
