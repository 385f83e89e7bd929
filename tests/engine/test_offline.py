"""Prompts through the engine without HTTP: batching and arrival order change no greedy token."""

from __future__ import annotations

import time

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import GenerationFailed, generate_tokens
from splitserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def assert_all_pages_back(engine: Engine, timeout: float = 5.0) -> None:
    """The engine's snapshot is taken once per loop turn, after the outputs: wait for the next one."""
    deadline = time.monotonic() + timeout
    while True:
        usage = engine.state().kv
        if usage.free + usage.cached == usage.capacity and usage.locked == 0 and usage.slots_in_use == 0:
            return
        assert time.monotonic() < deadline, f"pages not back: {usage}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=4096,
                                 max_running_requests=8, chunked_prefill_size=16))
    engine.start()
    yield engine
    engine.stop()


def test_staggered_arrivals_give_the_same_tokens_as_one_prompt_at_a_time(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (2, 9, 33, 5, 70)]
    alone = [generate_tokens(engine, [p], GREEDY)[0] for p in prompts]
    together = generate_tokens(engine, prompts, GREEDY, stagger_s=0.01)
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_a_failed_request_raises_with_its_reason(engine: Engine) -> None:
    bad = SamplingParams(max_new_tokens=4, temperature=0.0)
    # 5000 tokens: over the context (4096) and over this engine's KV cache (4096 tokens).
    with pytest.raises(GenerationFailed, match="a prompt of 5000 tokens does not fit; this engine takes 1 to 4095"):
        generate_tokens(engine, [[1] * 5000], bad, timeout=30)
    assert generate_tokens(engine, [[1] * 20], bad)  # and the engine keeps serving


def test_a_prompt_larger_than_the_kv_cache_is_refused_not_queued_forever() -> None:
    small = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=64, max_running_requests=2))
    small.start()
    try:
        with pytest.raises(GenerationFailed, match="KV cache 64 tokens"):
            generate_tokens(small, [[1] * 100], SamplingParams(max_new_tokens=2), timeout=30)
        assert small.state().waiting == 0
    finally:
        small.stop()


def test_a_request_that_fills_the_whole_kv_cache_ends_with_length_and_frees_it() -> None:
    small = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=64, max_running_requests=2))
    small.start()
    try:
        (tokens,) = generate_tokens(small, [[1] * 50], SamplingParams(max_new_tokens=100, temperature=0.0,
                                                                       ignore_eos=True), timeout=30)
        assert 10 <= len(tokens) < 100  # stopped when the 64-token cache was full, not at max_tokens
        assert_all_pages_back(small)
    finally:
        small.stop()


def test_a_crash_in_the_loop_fails_every_request_and_refuses_new_ones() -> None:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=256, max_running_requests=2))
    engine.start()
    try:
        def broken_schedule():
            raise RuntimeError("scheduler bug")

        engine.call_soon(lambda: setattr(engine.scheduler, "schedule", broken_schedule))
        with pytest.raises(GenerationFailed, match="engine loop crashed: RuntimeError\\('scheduler bug'\\)"):
            generate_tokens(engine, [[1, 2, 3]], GREEDY, timeout=10)
        assert not engine.alive and engine.failure
        with pytest.raises(GenerationFailed, match="engine loop crashed"):
            generate_tokens(engine, [[4, 5]], GREEDY, timeout=10)
    finally:
        engine.stop()


def test_a_step_of_one_token_chunks_where_a_prompt_chunk_samples_nothing() -> None:
    # Chunks of 2: a 1-token prompt tail and a 1-token middle chunk of another prompt share a step
    # with decodes, so the step takes the decode path while one row samples nothing.
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024,
                                 max_running_requests=4, chunked_prefill_size=2))
    engine.start()
    try:
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 7, 5)]
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        alone = [generate_tokens(engine, [p], params)[0] for p in prompts]
        assert generate_tokens(engine, prompts, params) == alone
        assert_all_pages_back(engine)
    finally:
        engine.stop()


def test_more_prompts_than_the_bounded_inbox_all_complete() -> None:
    # An inbox of 2 and a waiting queue of 2: 24 prompts at once must wait for room, not be refused.
    small = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024,
                                max_running_requests=2, max_inbox=2, max_waiting_requests=2))
    small.start()
    try:
        prompts = [[1 + i, 2, 3] for i in range(24)]
        together = generate_tokens(small, prompts, GREEDY, timeout=120)
        assert together[:3] == [generate_tokens(small, [p], GREEDY)[0] for p in prompts[:3]]
        assert all(len(t) == 12 for t in together)
        assert_all_pages_back(small)
    finally:
        small.stop()
