"""The asyncio side of the engine: submit a request, iterate its outputs, abort on cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from splitserve.engine.engine import Engine
from splitserve.engine.image_items import ImageItem
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams


class EngineClient:
    """Bridges the engine's loop thread and the server's event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       bootstrap_addr: str | None = None, bootstrap_room: int | None = None,
                       images: list[ImageItem] | None = None) -> AsyncIterator[TokenOutput]:
        """Yields the request's outputs until one has a finish reason.

        If the consumer stops early (client gone, task cancelled), the request is aborted and
        its pages are freed by the engine loop.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()

        def deliver(out: TokenOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        req = Request(request_id=request_id, prompt_ids=prompt_ids, params=params, on_output=deliver,
                      bootstrap_addr=bootstrap_addr, bootstrap_room=bootstrap_room, images=images or [])
        self.engine.submit(req)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id, "client disconnected")
