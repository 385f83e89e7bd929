"""The asyncio side of the engine: submit a request, iterate its outputs, abort on cancel.

`EngineClient` is what the HTTP server sees of an engine running in its own process's thread;
`api/core_client.py` offers the same interface for an engine core in a process of its own.

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
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest
from starlette.routing import Route

from splitserve.engine.engine import Engine
from splitserve.engine.grammar.spec import GrammarSpec
from splitserve.engine.multimodal.image_items import ImageItem
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.role_switch import RoleSwitch


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


def engine_health(engine: Engine) -> tuple[bool, dict[str, Any]]:
    """/health's answer: whether the engine serves, and the body."""
    if not engine.alive:
        return False, {"status": engine.failed or "engine loop not running"}
    # `draining`: new requests are refused (a role switch): routers pick it no more, its requests go on.
    return True, {"status": "ok", "role": engine.role.name, "draining": engine.refusing is not None,
                  **engine.role.health_info()}


def engine_state_report(engine: Engine) -> dict[str, Any]:
    """/internal/state's body: the loop's last snapshot and the KV cache's counts."""
    s = engine.state()
    kv = s.kv
    return {
        "role": engine.role.name, "running": s.running, "waiting": s.waiting, "parked": s.parked,
        "requests": len(engine.requests),
        "kv_capacity": kv.capacity, "kv_free": kv.free, "kv_cached": kv.cached, "kv_locked": kv.locked,
        "kv_available": kv.available, "kv_used_by_requests": kv.used_by_requests,
        "slots_in_use": kv.slots_in_use, "steps": engine.steps,
        "prefix_hit_tokens": engine.kv.prefix_cache.hit_tokens, "failure": engine.failed,
        "tp_worker_pids": engine.tp_supervisor.pids() if engine.tp_supervisor is not None else {},
        "role_held": engine.role.held(),  # the role's transfer rooms, aux slots, fenced pages in use
        **engine.role.state_info(),
    }


class EngineClient:
    """Bridges the engine's loop thread and the server's event loop (the engine runs in this process)."""

    def __init__(self, engine: Engine, role_switch: RoleSwitch | None = None) -> None:
        self.engine = engine
        self.role_switch = role_switch  # switches prefill <-> decode at runtime (POST /internal/role)
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
        self.model_name = engine.cfg.model_name
        self.model_cfg = engine.model_cfg
        self.model_folder = engine.model_folder
        self.tokenizer = engine.tokenizer
        self.context_length = engine.context_length
        self.max_prompt_tokens = engine.max_prompt_tokens
        self.tool_call_parser = engine.cfg.tool_call_parser

    @property
    def role_name(self) -> str:
        """The engine's role now (a role switch changes it)."""
        return self.engine.role.name

    def routes(self) -> list[Route]:
        """The role's own endpoints (the encoder's /v1/encode)."""
        return self.engine.role.routes()

    def abort(self, request_id: str, reason: str) -> None:
        self.engine.abort(request_id, reason)

    async def health(self) -> tuple[bool, dict[str, Any]]:
        ok, body = engine_health(self.engine)
        if ok and self.role_switch is not None:
            body.update(self.role_switch.status())
        return ok, body

    async def metrics(self) -> bytes:
        return generate_latest(self.engine.metrics.registry)

    async def internal_state(self) -> dict[str, Any]:
        return engine_state_report(self.engine)

    async def page_events(self, epoch: str | None, seq: int) -> dict[str, Any]:
        return self.engine.page_events.since(epoch, seq)

    async def flush_cache(self) -> int:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.engine.call_soon(lambda: loop.call_soon_threadsafe(done.set_result, self.engine.kv.prefix_cache.flush()))
        return await done

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compiles off the loop thread (raises InvalidGrammar); the loop then finds it in the cache."""
        await asyncio.to_thread(self.engine.grammar.compile, spec)

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
