"""The bridge from the engine's thread to the event loop: outputs in order, one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from splitserve.api.engine_client import Outbox
from splitserve.engine.request import TokenOutput


def test_a_steps_outputs_reach_their_queues_in_order_with_one_wake_up() -> None:
    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wake_ups
            wake_ups += 1
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        outbox = Outbox(loop)
        queues: list[asyncio.Queue[TokenOutput]] = [asyncio.Queue() for _ in range(3)]

        def engine_steps() -> None:
            for step in range(50):
                for i, queue in enumerate(queues):
                    outbox.put(queue, TokenOutput(f"r{i}", [step], str(step)))

        engine = threading.Thread(target=engine_steps)
        engine.start()
        engine.join()  # the loop is held here: everything the thread sent waits in the outbox
        got = [[(await q.get()).token_ids[0] for _ in range(50)] for q in queues]
        assert all(q.empty() for q in queues)
        outbox.put(queues[0], TokenOutput("r0", [99], ""))  # the outbox is empty again: a new wake-up
        assert (await queues[0].get()).token_ids == [99]
        return got, wake_ups

    got, wake_ups = asyncio.run(run())
    assert got == [list(range(50))] * 3
    assert wake_ups == 2
