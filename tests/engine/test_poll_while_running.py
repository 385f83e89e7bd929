"""While the device runs a step the loop waits for, the role's transfers are still polled: a decode whose request's
KV lands mid-step sends that request's first token (read from the prefill's aux data) at once, where it used to
wait for the step to end, and then for the loop to come round (the `kv_notice` phase: 5-10 ms of a disaggregated
TTFT on an H100 at 8-24 req/s).

The CPU computes a step at once, so the device is slowed here: each step's pending result becomes ready only
`STEP_S` after its launch (the overlap scheduler forced on, as on a GPU). The role stands in for a decode: it holds
a request from its arrival and releases it from its poll once the test says the KV has landed."""

from __future__ import annotations

import threading
import time

import pytest
from slow_device import slow_down

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request, TokenOutput
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

STEP_S = 0.3
HELD = 7  # prompts starting with this token are held by the role until `landed` is set


class HoldsUntilLanded(Role):
    """Parks held requests at arrival and ends them from the first poll after `landed` is set, as a decode ends a
    request's wait for its KV; asks to be polled while it holds any."""

    def __init__(self) -> None:
        self.held: list[Request] = []
        self.landed = threading.Event()
        self.polls = self.transfer_polls = 0

    def on_arrival(self, req: Request) -> bool:
        if req.prompt_ids[0] != HELD:
            return False
        self.engine.park(req)
        self.held.append(req)
        return True

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.held else None

    def poll(self) -> None:
        self.polls += 1
        self.poll_transfers()

    def poll_transfers(self) -> None:
        self.transfer_polls += 1
        if self.landed.is_set():
            while self.held:
                self.engine.finish(self.held.pop(), FinishReason.STOP)


@pytest.mark.parametrize("polls_while_running", [True, False])
def test_a_transfer_that_lands_mid_step_is_taken_before_the_step_ends(polls_while_running: bool) -> None:
    role = HoldsUntilLanded()
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=2048,
                                 max_running_requests=8), role=ComposedRole("decode", [role]))
    slow_down(engine, STEP_S)
    if not polls_while_running:  # the loop as it was: the step's end first, the role's poll after
        engine._poll_while_running = lambda step: None
    tokens, held_done = threading.Event(), threading.Event()
    outputs: list[int] = []
    ended_at: list[float] = []

    def long_output(out: TokenOutput) -> None:
        outputs.extend(out.token_ids)
        if len(outputs) >= 2:
            tokens.set()

    def held_output(out: TokenOutput) -> None:
        if out.finish_reason is not None:
            ended_at.append(time.monotonic())
            held_done.set()

    greedy = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    engine.start()
    try:
        engine.submit(Request("long", [5, 6, 8, 9], greedy, long_output))  # keeps a slow step in flight
        engine.submit(Request("held", [HELD, 1, 2, 3], greedy, held_output))
        assert tokens.wait(30)
        time.sleep(STEP_S / 3)  # well inside a step
        landed_at = time.monotonic()
        role.landed.set()
        assert held_done.wait(30)
        engine.abort("long", "test over")
    finally:
        engine.stop()
    waited = ended_at[0] - landed_at
    if polls_while_running:
        assert waited < STEP_S / 3, f"the landed request waited {waited * 1e3:.0f} ms for the step in flight"
        # Only the transfers are polled while a step runs: the role's own poll stays at once a loop turn.
        assert role.transfer_polls > 20 * role.polls, (role.polls, engine.steps, role.transfer_polls)
    else:  # what the test tells apart: the step's remaining time, at least
        assert waited > STEP_S / 3, waited
