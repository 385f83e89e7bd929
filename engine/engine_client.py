"""The asyncio side of the engine: submit a request, iterate its outputs, abort on cancel.

Outputs cross from the engine's thread to the event loop through one outbox per loop: the engine
thread appends and wakes the loop only when the outbox was empty, so a step of a few hundred
requests costs the engine thread one wake-up (a write to the loop's self-pipe) instead of one per
token, and the loop hands out the whole step's outputs in one callback.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator

from splitserve.engine.engine import Engine
from splitserve.engine.image_items import ImageItem
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams


class Outbox:
    """Outputs on their way from the engine's thread to one event loop's queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[TokenOutput], TokenOutput]] = []

    def put(self, queue: asyncio.Queue[TokenOutput], out: TokenOutput) -> None:
        """Called on the engine's thread."""
        with self._lock:
            self._items.append((queue, out))
            wake = len(self._items) == 1
        if wake:
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, out in items:
            queue.put_nowait(out)


class EngineClient:
    """Bridges the engine's loop thread and the server's event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 bootstrap_addr: str | None = None, bootstrap_room: int | None = None,
                 images: list[ImageItem] | None = None) -> AsyncIterator[TokenOutput]:
        """Submits the request now (raises EngineOverloaded, taking nothing, when the engine is
        full) and returns its outputs, which end with one that has a finish reason.

        If the consumer stops early (client gone, task cancelled), the request is aborted and
        its pages are freed by the engine loop; one never iterated must be aborted by the caller.
        """
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop) or self._outboxes.setdefault(loop, Outbox(loop))
        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()

        def deliver(out: TokenOutput) -> None:
            outbox.put(outputs, out)

        req = Request(request_id=request_id, prompt_ids=prompt_ids, params=params, on_output=deliver,
                      bootstrap_addr=bootstrap_addr, bootstrap_room=bootstrap_room, images=images or [])
        self.engine.submit(req)
        return self._outputs(request_id, outputs)

    async def _outputs(self, request_id: str, outputs: asyncio.Queue[TokenOutput]) -> AsyncIterator[TokenOutput]:
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id, "client disconnected")
