"""A request that runs alone and finds no page for its next token ends (finish reason length) only when it holds
every page in use: where others hold pages that come back (a decode's reservations for KV still arriving), it waits
for them. A decode ended such requests short: an 88-token request in a 256-token cache, the rest reserved."""

from __future__ import annotations

import threading

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request, TokenOutput
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

PAGE, CACHE_TOKENS, HELD_PAGES = 4, 64, 10


class ReservesPages(Role):
    """Takes pages at start, as a decode reserves them for KV on its way, and gives them back from its poll once
    `arrived` is set."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.arrived = threading.Event()

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.held else None

    def poll(self) -> None:
        if not self.held:
            return
        if not self.engine.requests and not self.arrived.is_set():  # take them before the request arrives
            return
        if self.arrived.is_set():
            self.engine.kv.allocator.free(self.held)
            self.held = []


def serve(max_new_tokens: int, give_back: bool) -> tuple[list[int], FinishReason | None, int]:
    role = ReservesPages()
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, max_total_tokens=CACHE_TOKENS,
                                 max_running_requests=4), role=ComposedRole("decode", [role]))
    role.held = engine.kv.take_pages(HELD_PAGES)
    free_before = engine.kv.allocator.free_count
    tokens: list[int] = []
    done = threading.Event()
    finish: list[FinishReason | None] = []

    def on_output(out: TokenOutput) -> None:
        tokens.extend(out.token_ids)
        if out.finish_reason is not None:
            finish.append(out.finish_reason)
            done.set()

    engine.start()
    try:
        engine.submit(Request("lone", [1, 2, 3, 4], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                                     ignore_eos=True), on_output))
        # It runs out of pages with 10 held: it either ends now or waits; once it makes no progress, the KV lands
        # (the reserved pages go to a request: here back to the cache).
        seen = -1
        while not done.wait(0.5) and len(tokens) != seen:
            seen = len(tokens)
        if give_back:
            role.arrived.set()
        assert done.wait(60)
    finally:
        engine.stop()
    return tokens, finish[0], free_before


def test_a_lone_request_waits_for_pages_held_elsewhere_and_completes() -> None:
    # 4 prompt tokens + 40 output tokens: 11 pages, more than the 16 - 10 held leave.
    tokens, finish, _ = serve(40, give_back=True)
    assert finish is FinishReason.LENGTH and len(tokens) == 40  # its max_new_tokens, not the cache


def test_a_request_that_holds_every_page_in_use_still_ends() -> None:
    """The reserved pages given back, the request outgrows the whole cache: it ends with what fits."""
    tokens, finish, _ = serve(200, give_back=True)
    # Its last token needs no KV of its own: up to one past the cache.
    assert finish is FinishReason.LENGTH and CACHE_TOKENS - 2 * PAGE <= 4 + len(tokens) <= CACHE_TOKENS + 1
