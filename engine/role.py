"""What a role adds to the engine loop. The unified engine adds nothing; prefill and decode
(in engine/roles/) override the hooks, so the loop itself has no `if role == ...` branches.

Roles compose. A role is a list of *behaviours*, each a `Role` subclass in its own module that adds
one thing to the loop: prefill = KV sender (+ embedding receiver when the model takes images);
decode = KV receiver (+ verifier when a drafter is attached); encode = vision tower + embedding
sender; drafter = draft model + draft-mesh server; unified may take a verifier too.
`ComposedRole` runs the behaviours' hooks in order (see its docstring for how their answers
combine), and `engine/roles/build_role` picks the list for `--role`.

Behaviours change what a step computes (image embeddings in a prompt, draft tokens to verify)
through fields of the `Request` that the scheduler and the runner read, never by reaching into
the runner; and they take requests in and out of the batch through the engine (`park`, `finish`,
`scheduler.add`), never by editing the scheduler's lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.routing import Route

from splitserve.engine.request import FinishReason, Request

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine


class Role:
    """Hooks the engine loop calls; every default is the unified engine's behaviour."""

    name = "unified"
    # What this behaviour hands to the next role on a switch, by name (a KV transfer endpoint, an embedding
    # receiver), and that thing from the previous role once `take_over` found it there (before `attach`).
    hands_over: str | None = None
    taken_over: Any = None

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

    def state_info(self) -> dict[str, Any]:
        """Extra fields for /internal/state (e.g. the Mooncake session the KV endpoint listens on)."""
        return {}

    def on_finish(self, req: Request) -> None:
        """The request is retiring (finished, aborted or failed): drop per-request role state."""

    def on_preempted(self, req: Request) -> None:
        """The scheduler gave the request's pages back and requeued it (told once the step's plan is made, so it
        may be admitted again already): the tokens of steps launched before will not reach `on_token`."""

    def routes(self) -> list[Route]:
        """HTTP endpoints the role adds to the engine's API (e.g. the encode role's /v1/encode)."""
        return []

    def core_calls(self) -> dict[str, Callable[[Any], Any]]:
        """The core side of the role's endpoints under `serve --engine-process`: calls by name that
        the engine core process answers for its API server (wire data in, wire data out; any thread)."""
        return {}

    def idle_poll_interval(self) -> float | None:
        """How long the idle loop may sleep (None: the engine's default)."""
        return None

    def poll_transfers(self) -> None:
        """While the device runs a step the loop waits for: take what the role's transfers delivered (a decode: the
        requests whose KV landed), and nothing else. Called often, two steps in flight: nothing step-paced (a
        speculation gate) and no new reservation of pages (one freed by a request that ended may still be written by
        the step in flight) belongs here."""

    def before_launch(self) -> None:
        """Called just before each step is launched (a role whose device work shares the steps' stream may get it
        queued first)."""

    def allows_overlap(self) -> bool:
        """False while the role needs every step's tokens on the host before the next is planned
        (the verifier, while requests have drafters: a draft is verified only after the token it
        follows is known). Asked at every step."""
        return True

    def serves_structured_outputs(self) -> bool:
        """Whether requests that reach this engine may carry a grammar (so its compiler is built at start)."""
        return True

    def held(self) -> dict[str, int]:
        """What the role still holds beyond its requests (transfer rooms, aux slots, fenced pages), by
        name: every count 0 when it is idle (a role switch waits for that before closing the role)."""
        return {}

    def close(self) -> None:
        """The engine is stopping."""

    def hand_over(self) -> dict[str, Any]:
        """A role switch ends this role (engine/role_switch.py): closes it, but for what the next role may
        take over, returned by name instead of closed (the KV transfer endpoint: its Mooncake engine
        cannot be destroyed, so a new one per switch would pile up)."""
        self.close()
        return {}

    def take_over(self, kept: dict[str, Any]) -> set[str]:
        """Before `attach`, on a role switch: keeps what the previous role handed over that this one
        uses (`taken_over`: what it hands over itself, by the same name), and returns those names (the
        switch closes the rest)."""
        if self.hands_over is None or self.hands_over not in kept:
            return set()
        self.taken_over = kept[self.hands_over]
        return {self.hands_over}


class UnifiedRole(Role):
    """Prefill and decode in one engine: the reference every split deployment must match."""


class ComposedRole(Role):
    """Several behaviours acting as one role, their hooks called in list order.

    - `on_arrival`: each behaviour sees the request until one of them finishes it (a refusal);
      the request is held out of the scheduler if any behaviour holds it. At most one behaviour
      may hold a request at a time, and the holder hands it to the scheduler when it is done.
    - `on_token`: each behaviour sees the token; the request is taken over if any takes it.
    - `poll`, `on_chunk_done`, `on_finish`: every behaviour (`on_finish` also for requests a behaviour
      never saw, when an earlier one refused them); `close`, `hand_over`: every one, in reverse.
    - `health_info`, `state_info`: the behaviours' fields merged; `idle_poll_interval`: the shortest asked for;
      `poll_transfers`, `before_launch`: every behaviour; `allows_overlap`: only if every behaviour allows it;
      `serves_structured_outputs`: if any does;
      `routes`, `core_calls`: every behaviour's; `held`: the behaviours' counts added up; `take_over`:
      every behaviour takes what it uses, and the role carries the rest (`carried`) to hand over again.
    """

    def __init__(self, name: str, behaviours: list[Role]) -> None:
        if not behaviours:
            raise ValueError(f"role {name!r} needs at least one behaviour")
        self.name = name
        self.behaviours = behaviours
        # What an earlier role handed over that none of these behaviours uses (a prefill's embedding receiver
        # while the engine decodes): carried for a switch back, closed when the engine stops.
        self.carried: dict[str, Any] = {}

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        for b in self.behaviours:
            b.attach(engine)

    def on_arrival(self, req: Request) -> bool:
        held = False
        for b in self.behaviours:
            if req.finished:
                return True  # refused by an earlier behaviour: it is no one's to hold any more
            held = b.on_arrival(req) or held
        return held or req.finished

    def poll(self) -> None:
        for b in self.behaviours:
            b.poll()

    def on_chunk_done(self, req: Request, computed_len: int) -> None:
        for b in self.behaviours:
            b.on_chunk_done(req, computed_len)

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        taken = False
        for b in self.behaviours:
            taken = b.on_token(req, finish) or taken
        return taken

    def health_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for b in self.behaviours:
            info.update(b.health_info())
        return info

    def state_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for b in self.behaviours:
            info.update(b.state_info())
        return info

    def on_finish(self, req: Request) -> None:
        failed: Exception | None = None
        for b in self.behaviours:
            try:
                b.on_finish(req)
            except Exception as exc:  # the others must still drop what they hold for the request
                failed = failed or exc
        if failed is not None:
            raise failed

    def on_preempted(self, req: Request) -> None:
        for b in self.behaviours:
            b.on_preempted(req)

    def routes(self) -> list[Route]:
        return [r for b in self.behaviours for r in b.routes()]

    def core_calls(self) -> dict[str, Callable[[Any], Any]]:
        return {name: call for b in self.behaviours for name, call in b.core_calls().items()}

    def idle_poll_interval(self) -> float | None:
        asked = [t for t in (b.idle_poll_interval() for b in self.behaviours) if t is not None]
        return min(asked) if asked else None

    def poll_transfers(self) -> None:
        for b in self.behaviours:
            b.poll_transfers()

    def before_launch(self) -> None:
        for b in self.behaviours:
            b.before_launch()

    def allows_overlap(self) -> bool:
        return all(b.allows_overlap() for b in self.behaviours)

    def serves_structured_outputs(self) -> bool:
        return any(b.serves_structured_outputs() for b in self.behaviours)

    def held(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for b in self.behaviours:
            for name, n in b.held().items():
                counts[name] = counts.get(name, 0) + n
        return counts

    def close(self) -> None:
        for b in reversed(self.behaviours):
            b.close()
        for thing in self.carried.values():
            thing.close()

    def hand_over(self) -> dict[str, Any]:
        kept: dict[str, Any] = dict(self.carried)
        for b in reversed(self.behaviours):
            kept.update(b.hand_over())
        return kept

    def take_over(self, kept: dict[str, Any]) -> set[str]:
        used = set().union(*(b.take_over(kept) for b in self.behaviours))
        self.carried = {name: thing for name, thing in kept.items() if name not in used}
        return set(kept)
