"""Outputs that a role's poll produces go out at once: the engine flushes them (its `after_step` hook, which
sends outputs to the API server when the core runs in its own process) before it launches the next step.

A decode takes a request's first token from the prefill's aux data in its poll; flushed only after the step
launched next (and, with overlap, the one in flight before it), every disaggregated request's first token
waited up to two steps' time in the engine core.
"""

from __future__ import annotations

import threading

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request, TokenOutput
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

HELD = 7  # prompts starting with this token are held by the role and ended from its poll


class EndsHeldRequestsFromPoll(Role):
    """Holds some requests at arrival and ends them from its next poll, as a decode ends a request whose
    transfer failed (or hands on its first token once the KV arrived)."""

    def __init__(self) -> None:
        self.held: list[Request] = []

    def on_arrival(self, req: Request) -> bool:
        if req.prompt_ids[0] != HELD:
            return False
        self.engine.park(req)
        self.held.append(req)
        return True

    def poll(self) -> None:
        while self.held:
            self.engine.finish(self.held.pop(), FinishReason.ERROR, "ended from the role's poll")


def test_outputs_from_a_roles_poll_are_flushed_before_the_next_step_runs() -> None:
    events: list[tuple[str, str, int]] = []  # ("emit", request id, steps) / ("flush", "", steps), loop order
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=2048,
                                 max_running_requests=8), role=ComposedRole("unified", [EndsHeldRequestsFromPoll()]))
    engine.after_step = lambda: events.append(("flush", "", engine.steps))
    running, done = threading.Event(), threading.Event()

    def on_output(rid: str):
        def record(out: TokenOutput) -> None:
            events.append(("emit", rid, engine.steps))
            if rid == "long" and len([e for e in events if e[1] == "long"]) >= 3:
                running.set()
            if out.finish_reason is not None and rid != "long":
                done.set()
        return record

    greedy = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    engine.start()
    try:
        engine.submit(Request("long", [5, 6, 8, 9], greedy, on_output("long")))  # keeps a step running
        assert running.wait(60)
        held = [Request(f"held-{i}", [HELD, 1, 2, 3], greedy, on_output(f"held-{i}")) for i in range(3)]
        for req in held:
            engine.submit(req)
            assert done.wait(60)
            done.clear()
        engine.abort("long", "test over")
    finally:
        engine.stop()
    for rid in (req.request_id for req in held):
        at = next(i for i, e in enumerate(events) if e[:2] == ("emit", rid))
        flush = next(e for e in events[at:] if e[0] == "flush")
        assert flush[2] == events[at][2], f"{rid}'s output waited for a step before it was flushed: {events[at:]}"
    assert any(e[0] == "emit" and e[1] == "long" and e[2] > 3 for e in events)  # steps ran meanwhile
