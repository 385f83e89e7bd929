"""Preemption under the overlap scheduler: a request preempted while its step is in flight, and admitted
again into the same slot before that step is read back, gets none of that step's tokens.

On the CPU a step is computed at once, so forcing the overlap scheduler tests its bookkeeping alone: the
step launched next is planned before the last one's tokens are taken in, as on a GPU.
"""

from __future__ import annotations

import random

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(8, 60), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    return prompts, params


def serve(prompts: list[list[int]], params: list[SamplingParams], kv_tokens: int, overlap: bool,
          prefix_cache: bool = True) -> tuple[list[list[int]], float, Engine]:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=kv_tokens,
                                 max_running_requests=16, disable_prefix_cache=not prefix_cache))
    engine.overlap = overlap
    engine.start()
    try:
        outputs = generate_tokens(engine, prompts, params, timeout=120)
    finally:
        engine.stop()
    preemptions = engine.metrics.registry.get_sample_value("splitserve_preemptions_total", {"model": "tiny"})
    return outputs, preemptions or 0.0, engine


@pytest.mark.parametrize(("kv_tokens", "prefix_cache"), [(256, True), (256, False), (160, True)])
def test_greedy_output_under_preemption_and_overlap_equals_an_unhurried_engine(kv_tokens: int,
                                                                              prefix_cache: bool) -> None:
    prompts, params = workload(seed=0)
    want, none, _ = serve(prompts, params, kv_tokens=8192, overlap=False)
    assert none == 0
    got, preemptions, engine = serve(prompts, params, kv_tokens=kv_tokens, overlap=True, prefix_cache=prefix_cache)
    assert preemptions >= 5  # the cache is small enough that requests keep preempting each other
    assert got == want
    state = engine.state()
    assert (state.running, state.waiting, state.kv.slots_in_use) == (0, 0, 0)
    assert state.kv.free + state.kv.cached == state.kv.capacity and state.kv.locked == 0
