"""The benchmarks' nvidia-smi sampler: a reading that fails is counted, never taken, and the sampler still stops."""

from __future__ import annotations

import shutil
import time

import pytest

from splitserve.bench.gpu_sampler import GpuSampler, spread


def test_spread_is_min_median_max() -> None:
    assert spread([3.0, 1.0, 2.0, 10.0]) == [1.0, 2.5, 10.0]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="needs a machine without nvidia-smi")
def test_failed_readings_are_counted_and_the_sampler_stops() -> None:
    with GpuSampler("GPU-0", period_s=0.01) as sampler:
        deadline = time.monotonic() + 5
        while sampler.errors < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert sampler.errors >= 3
    assert sampler.samples == []
    assert not sampler._thread.is_alive()
