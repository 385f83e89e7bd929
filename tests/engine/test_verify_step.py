"""The engine's verify step: a behaviour offers draft tokens through `Request.draft_tokens`, one
forward covers the last token and the draft, and the output is that of plain decoding."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.request import RequestStatus
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


class OracleDrafts(Role):
    """Offers each decoding request the next K tokens of a known continuation, every `wrong_every`
    one of them replaced by a token that is never right."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int, wrong_every: int = 0) -> None:
        self.continuations, self.k, self.wrong_every = continuations, k, wrong_every
        self.offered = 0

    def poll(self) -> None:
        for req in self.engine.requests.values():
            if req.status is not RequestStatus.RUNNING or req.pending_len != 1 or not req.output_ids:
                continue
            rest = self.continuations[tuple(req.prompt_ids)][len(req.output_ids):][: self.k]
            if self.wrong_every:
                rest = [(t + 1) % 300 if (len(req.output_ids) + i) % self.wrong_every == 0 else t
                        for i, t in enumerate(rest)]
            req.draft_tokens = rest
            self.offered += len(rest)


def engine_for(role: Role | None) -> Engine:
    cfg = EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024, max_running_requests=4)
    return Engine(cfg, role=role)


def run(role: Role | None, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], Engine]:
    engine = engine_for(role)
    engine.start()
    try:
        start = engine.kv.usage()
        out = generate_tokens(engine, prompts, params)
        return out, engine
    finally:
        engine.stop()
        usage = engine.kv.usage()
        assert usage.free + usage.cached == usage.capacity and usage.locked == 0 and usage.slots_in_use == 0
        assert usage.capacity == start.capacity


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return run(None, PROMPTS, GREEDY)[0]


def continuations(plain: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): out for p, out in zip(PROMPTS, plain, strict=True)}


@pytest.mark.parametrize("k", [1, 3, 6])
def test_right_drafts_are_all_accepted_and_the_output_is_plain_decodings(plain, k) -> None:
    oracle = OracleDrafts(continuations(plain), k)
    out, engine = run(ComposedRole("unified", [oracle]), PROMPTS, GREEDY)
    assert out == plain
    drafted = engine.metrics.spec_draft_tokens._value.get()
    assert drafted > 0 and engine.metrics.spec_accepted_tokens._value.get() == drafted
    assert engine.steps < run(None, PROMPTS, GREEDY)[1].steps  # several tokens per step


def test_wrong_drafts_are_rejected_and_the_output_is_plain_decodings(plain) -> None:
    oracle = OracleDrafts(continuations(plain), 4, wrong_every=3)
    out, engine = run(ComposedRole("unified", [oracle]), PROMPTS, GREEDY)
    assert out == plain
    drafted = engine.metrics.spec_draft_tokens._value.get()
    accepted = engine.metrics.spec_accepted_tokens._value.get()
    assert drafted > 0 and 0 < accepted < drafted


def test_stops_and_max_tokens_end_a_verified_request_where_plain_decoding_does(plain) -> None:
    stop_token = plain[0][7]
    params = SamplingParams(max_new_tokens=13, temperature=0.0, stop_token_ids=[stop_token], ignore_eos=True)
    reference = run(None, PROMPTS, params)[0]
    oracle = OracleDrafts(continuations(plain), 6)
    assert run(ComposedRole("unified", [oracle]), PROMPTS, params)[0] == reference
    assert reference[0][-1] == stop_token and all(len(o) <= 13 for o in reference)
