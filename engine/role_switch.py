"""Switching an engine between prefill and decode at runtime, its weights, KV pool and prefix cache kept.

A switch (`POST /internal/role`, api/role_endpoint.py) runs in three phases:

1. Drain. The engine refuses new requests (503 with Retry-After: the router retries them on another
   backend) and /health says `draining`, so routers stop picking it; what it holds runs to its end (a
   prefill's requests until their KV reached the decode, a decode's until their last token). The drain
   lasts at least `settle_s`, so every router has probed it draining before its role changes: a router
   that still took it for the old role would send it the old role's half of a request.
2. Check, on the loop thread: nothing held, at the counts an idle engine has: no request, batch slot or
   page held by a request, and none of the role's transfer rooms, aux slots or fenced pages.
3. Swap, in the same call on the loop thread (no request can arrive in between): the old role's
   behaviours close (a prefill's bootstrap server) but for its KV transfer endpoint, which the new
   role takes over (its Mooncake engine and registered pool stay: peers' cached layouts of this engine
   stay true, and no engine is left behind per switch); the new role's behaviours are built and
   attached, and the engine takes requests again. /health reports the new role; routers move the
   backend to it (router/role_changes.py).

A drain that does not end within its timeout gives up: the old role stays and serves again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from splitserve.engine.engine import Engine
from splitserve.engine.role import ComposedRole, Role

logger = logging.getLogger(__name__)

SWITCHABLE = ("prefill", "decode")
POLL_S = 0.01  # how often a drain looks whether the engine is idle yet

T = TypeVar("T")


class RoleSwitchRefused(Exception):
    """The switch cannot run (or could not finish); `status` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409, code: str = "role_switch_refused") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class SwitchResult:
    """How a switch went: the roles, and how long its phases took (seconds)."""

    from_role: str
    to_role: str
    switched: bool
    drain_s: float = 0.0  # from refusing new requests until nothing was held
    swap_s: float = 0.0  # closing the old role's behaviours and attaching the new one's
    total_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def held_counts(engine: Engine) -> dict[str, int]:
    """What the engine still holds that an idle engine does not, by name (only counts above 0).
    Loop thread."""
    kv = engine.kv.usage()
    counts = {"requests": len(engine.requests), "inbox": engine.inbox_requests, "slots": kv.slots_in_use,
              "pages": kv.used_by_requests, "locked_pages": kv.locked, **engine.role.held()}
    return {name: n for name, n in counts.items() if n}


def release_partly_attached(role: Role, kept: dict[str, Any]) -> None:
    """Stops what a role whose attach failed part-way had started (a prefill's bootstrap server, its own new
    endpoint), leaving what it took over from `kept` for the next attempt. A behaviour that never attached
    holds nothing: its hand-over may fail, and is skipped."""
    for behaviour in reversed(role.behaviours if isinstance(role, ComposedRole) else [role]):
        try:
            handed = behaviour.hand_over()
        except Exception as exc:
            logger.debug("%s held nothing to release (%s)", type(behaviour).__name__, exc)
            continue
        for thing in handed.values():
            if all(thing is not k for k in kept.values()):
                thing.close()


class RoleSwitch:
    """Switches one engine's role (one switch at a time). `build(role)` makes the new role's
    behaviours (not attached yet): the same flags the engine started with, another `--role`."""

    def __init__(self, engine: Engine, build: Callable[[str], Role]) -> None:
        self.engine, self.build = engine, build
        self.target: str | None = None  # the role a switch in progress goes to
        self.phase: str | None = None  # "draining" | "swapping"
        self.last_held: dict[str, int] = {}  # what the drain last found held
        self._lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        """/health's fields while a switch runs (none otherwise)."""
        target, phase = self.target, self.phase
        return {} if target is None else {"switching_to": target, "switch_phase": phase}

    def refusal(self, role: Any) -> RoleSwitchRefused | None:
        """Why a switch to `role` cannot start now (None: it can, or `role` is the current one)."""
        if role not in SWITCHABLE:
            return RoleSwitchRefused(f"'role' must be one of {', '.join(SWITCHABLE)}, got {role!r}", 400,
                                     "invalid_role")
        current = self.engine.role.name
        if current not in SWITCHABLE:
            return RoleSwitchRefused(f"a {current} engine cannot switch roles: only prefill and decode engines "
                                     "switch (between each other)", 409, "role_not_switchable")
        if self.engine.cfg.tp_size > 1:
            return RoleSwitchRefused("a tensor-parallel engine cannot switch roles (its worker ranks hold the "
                                     "role's transfer state): restart it with the other --role", 409,
                                     "role_not_switchable")
        if self.target is not None:
            return RoleSwitchRefused(f"a switch to {self.target} is in progress ({self.phase})", 409,
                                     "switch_in_progress")
        if self.engine.failed is not None:
            return RoleSwitchRefused(f"the engine has failed: {self.engine.failed}", 409, "engine_failed")
        return None

    async def switch(self, role: str, settle_s: float, timeout_s: float) -> SwitchResult:
        """Drains, checks and swaps (see the module's docstring); a no-op for the current role. Raises
        RoleSwitchRefused (409 before it starts; 503 when the drain timed out, the old role kept)."""
        with self._lock:
            refused = self.refusal(role)
            if refused is not None:
                raise refused
            current = self.engine.role.name
            if role == current:
                return SwitchResult(current, role, switched=False)
            self.target, self.phase = role, "draining"
        start = time.monotonic()
        logger.info("switching role %s -> %s: draining", current, role)
        self.engine.refuse(f"the engine is switching its role from {current} to {role}; retry on another")
        try:
            while True:
                if time.monotonic() - start >= settle_s:
                    left = max(POLL_S, start + timeout_s - time.monotonic())
                    swapped = await self._on_loop(lambda: self._swap_if_idle(role), left)
                    if swapped is not None:
                        drained_at, done_at = swapped
                        result = SwitchResult(current, role, True, drained_at - start, done_at - drained_at,
                                              done_at - start)
                        logger.info("switched role %s -> %s: drained in %.3f s, swapped in %.3f s", current, role,
                                    result.drain_s, result.swap_s)
                        return result
                if time.monotonic() - start > timeout_s:
                    raise RoleSwitchRefused(f"the drain did not end within {timeout_s:g} s (still held: "
                                            f"{self.last_held}); the engine stays {current}", 503, "drain_timeout")
                await asyncio.sleep(POLL_S)
        finally:
            self.engine.refuse(None)
            self.target = self.phase = None

    async def _on_loop(self, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn()` run on the engine's loop thread (between steps), its result or exception here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:  # on the event loop
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(value)

        def run() -> None:
            try:
                value = fn()
            except BaseException as exc:  # handed to the caller
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, value, None)
        self.engine.call_soon(run)
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except asyncio.TimeoutError:
            raise RoleSwitchRefused(f"the engine loop did not answer within {timeout_s:g} s", 503,
                                    "drain_timeout") from None

    def _swap_if_idle(self, role: str) -> tuple[float, float] | None:
        """Loop thread: None while something is held; else swaps the roles and returns when the drain
        ended and when the swap did. Building the new role may fail (a port taken): the old one is
        built again and the engine goes on in it."""
        if self.target != role:
            return None  # the switch gave up (its drain timed out) before the loop got here
        held = held_counts(self.engine)
        if held:
            self.last_held = held
            return None
        drained_at = time.monotonic()
        self.phase = "swapping"
        old = self.engine.role
        kept = old.hand_over()  # the KV transfer endpoint goes on under the new role
        try:
            taken = self._attach(role, kept)
        except Exception as exc:
            logger.exception("switching to %s failed; going back to %s", role, old.name)
            try:
                taken = self._attach(old.name, kept)
            except Exception as again:  # neither role runs: the engine serves nothing any more
                self._close_unused(kept, set())
                self.engine.failure = f"switching to {role} failed ({exc}), and so did going back ({again})"
                raise RoleSwitchRefused(self.engine.failure, 500, "role_switch_failed") from again
            self._close_unused(kept, taken)
            raise RoleSwitchRefused(f"building the {role} role failed ({exc}); the engine stays {old.name}", 500,
                                    "role_switch_failed") from exc
        self._close_unused(kept, taken)
        return drained_at, time.monotonic()

    def _attach(self, role: str, kept: dict[str, Any]) -> set[str]:
        """Builds `role`, hands it what the old role kept and makes it the engine's; what it took."""
        new = self.build(role)
        taken = new.take_over(kept)
        try:
            self.engine.use_role(new)
        except Exception:
            release_partly_attached(new, kept)
            raise
        return taken

    @staticmethod
    def _close_unused(kept: dict[str, Any], taken: set[str]) -> None:
        for name, thing in kept.items():
            if name not in taken:
                thing.close()
