"""What a role adds to the engine loop. The unified engine adds nothing; prefill and decode
(in engine/roles/) override the hooks, so the loop itself has no `if role == ...` branches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitserve.engine.request import FinishReason, Request

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine


class Role:
    """Hooks the engine loop calls; every default is the unified engine's behaviour."""

    name = "unified"

    def attach(self, engine: Engine) -> None:
        """Called once by Engine.start, before the loop thread runs and before any request."""
        self.engine = engine

    def on_arrival(self, req: Request) -> bool:
        """A request arrived; return True if the role queues it itself (not the scheduler)."""
        return False

    def poll(self) -> None:
        """Called every loop iteration: advance transfers, move parked requests on."""

    def on_chunk_done(self, req: Request, computed_len: int) -> None:
        """A chunk of the request's tokens ran and its KV for positions < `computed_len` is in its
        pages, on the device too (a later step may already be queued: `req.kv_len` can be ahead)."""

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        """A token was appended (`finish` says if it ends the request); True takes the request over."""
        return False

    def health_info(self) -> dict[str, Any]:
        """Extra fields for /health (e.g. the prefill's bootstrap port)."""
        return {}

    def on_finish(self, req: Request) -> None:
        """The request is retiring (finished, aborted or failed): drop per-request role state."""

    def idle_poll_interval(self) -> float | None:
        """How long the idle loop may sleep (None: the engine's default)."""
        return None

    def close(self) -> None:
        """The engine is stopping."""


class UnifiedRole(Role):
    """Prefill and decode in one engine: the reference every split deployment must match."""
