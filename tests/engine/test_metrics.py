"""Engine metrics: a batched histogram update reads as the observations one by one."""

from __future__ import annotations

import math

from prometheus_client import generate_latest

from splitserve.engine.metrics import EngineMetrics, observe_times


def test_observe_times_equals_observing_one_by_one() -> None:
    batched, one_by_one = EngineMetrics("m"), EngineMetrics("m")
    for amount, times in [(0.0004, 3), (0.02, 250), (0.02, 1), (7.5, 2), (100.0, 4), (0.3, 0)]:
        observe_times(batched.itl, amount, times)
        for _ in range(times):
            one_by_one.itl.observe(amount)

    def itl_samples(m: EngineMetrics) -> dict[str, float]:
        lines = [line.rsplit(" ", 1) for line in generate_latest(m.registry).decode().splitlines()
                 if line.startswith("splitserve_inter_token_latency_seconds_") and "_created" not in line]
        return {name: float(value) for name, value in lines}

    got, want = itl_samples(batched), itl_samples(one_by_one)
    sum_name = 'splitserve_inter_token_latency_seconds_sum{model="m"}'
    assert math.isclose(got.pop(sum_name), want.pop(sum_name), rel_tol=1e-12)  # one product vs repeated adds
    assert got == want  # every bucket and the count exactly
    assert got['splitserve_inter_token_latency_seconds_count{model="m"}'] == 260
    assert got['splitserve_inter_token_latency_seconds_bucket{le="0.025",model="m"}'] == 254
