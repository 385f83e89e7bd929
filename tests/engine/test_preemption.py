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
from splitserve.engine.request import Request
from splitserve.engine.role import Role, UnifiedRole
from splitserve.engine.sampling_params import SamplingParams


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(8, 60), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    return prompts, params


def sampled_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded sampling with penalties and shared prompts (so requests wait for each other's pages and a
    preempted request's slot passes to another request before it comes back)."""
    rng = random.Random(seed)
    base = [[rng.randrange(3, 250) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    prompts = [list(rng.choice(base)) for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randrange(8, 60), temperature=rng.choice([0.3, 1.5]),
                             top_k=rng.choice([0, 5]), repetition_penalty=rng.choice([1.0, 1.3]), seed=1000 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


class PreemptionRecorder(UnifiedRole):
    """The unified role, counting the preemptions it is told of."""

    def __init__(self) -> None:
        self.preempted: list[str] = []

    def on_preempted(self, req: Request) -> None:
        assert req.tenure >= 1  # told once the plan is made: it may be running again already, in a new tenure
        self.preempted.append(req.request_id)


def serve(prompts: list[list[int]], params: list[SamplingParams], kv_tokens: int, overlap: bool,
          prefix_cache: bool = True, role: Role | None = None) -> tuple[list[list[int]], float, Engine]:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=kv_tokens,
                                 max_running_requests=16, disable_prefix_cache=not prefix_cache), role=role)
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
    recorder = PreemptionRecorder()
    got, preemptions, engine = serve(prompts, params, kv_tokens=kv_tokens, overlap=True, prefix_cache=prefix_cache,
                                     role=recorder)
    assert preemptions >= 5  # the cache is small enough that requests keep preempting each other
    assert len(recorder.preempted) == preemptions  # the role hears of each (a drafter forgets its stale tokens)
    assert got == want
    state = engine.state()
    assert (state.running, state.waiting, state.kv.slots_in_use) == (0, 0, 0)
    assert state.kv.free + state.kv.cached == state.kv.capacity and state.kv.locked == 0


def test_seeded_sampling_under_preemption_equals_an_unhurried_engine() -> None:
    """A seeded request's tokens depend on its seed, logits and position alone: also when it was preempted and
    came back into a slot whose sampler state another request had set meanwhile."""
    prompts, params = sampled_workload(seed=5)
    want, none, _ = serve(prompts, params, kv_tokens=8192, overlap=False)
    assert none == 0
    got, preemptions, _ = serve(prompts, params, kv_tokens=160, overlap=False)
    assert preemptions >= 5
    assert got == want
