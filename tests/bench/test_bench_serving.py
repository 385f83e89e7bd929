"""`splitserve bench --profile serving`: its loads, its bound, and one small run end to end on the CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from splitserve.bench.command import main as bench_main
from splitserve.bench.serving import Limits, fixed_load, measure_limits, packed, sharegpt_like_load


def test_sharegpt_like_load_is_seeded_bounded_and_arrives_at_its_rate() -> None:
    a = sharegpt_like_load(2000, 10.0, 200, 100, max_prompt=1024, max_output=300, seed=5)
    b = sharegpt_like_load(2000, 10.0, 200, 100, max_prompt=1024, max_output=300, seed=5)
    assert a == b
    assert a != sharegpt_like_load(2000, 10.0, 200, 100, max_prompt=1024, max_output=300, seed=6)
    assert all(4 <= p <= 1024 for p in a.prompt_lens) and all(1 <= o <= 300 for o in a.output_lens)
    assert sorted(a.prompt_lens)[1000] == pytest.approx(200, rel=0.15)  # the median it was given
    assert sum(a.prompt_lens) / 2000 > 250  # heavy-tailed: the mean above the median
    assert a.arrivals == sorted(a.arrivals) and a.arrivals[0] == 0.0
    assert a.arrivals[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate
    burst = sharegpt_like_load(8, math.inf, 200, 100, 1024, 300, seed=5)
    assert burst.arrivals == [0.0] * 8


def test_bound_counts_prefill_decode_steps_and_the_last_arrival() -> None:
    limits = Limits(copy_bandwidth_Bps=1e12, prefill_tok_s={512: 1e4, 2048: 2e4}, weight_bytes=10**10,
                    kv_bytes_per_token=10**5, max_batch=4)
    load = fixed_load("8x512:10")
    # 4096 prompt tokens at the best rate; 80 output tokens in steps of 4 at (1e10 + 4 * 517 * 1e5) / 1e12 s.
    want = 4096 / 2e4 + 20 * (1e10 + 4 * 517 * 1e5) / 1e12
    assert limits.load_seconds(load) == pytest.approx(want)
    late = type(load)(load.name, load.prompt_lens, load.output_lens, [0.0] * 7 + [100.0], 1.0)
    assert limits.load_seconds(late) == pytest.approx(100.0 + 512 / 2e4 + 9 * (1e10 + 512 * 1e5) / 1e12)


def test_bound_waits_for_the_longest_output_and_for_any_request_that_arrives_late() -> None:
    limits = Limits(copy_bandwidth_Bps=1e12, prefill_tok_s={512: 1e4}, weight_bytes=10**10,
                    kv_bytes_per_token=10**5, max_batch=256)
    # All at once, one output of 1,000 tokens among 99 of 10: ceil(1990 / 100) = 20 full-batch steps would say
    # 0.2 s of weights, but that request's tokens come one a step: at least 1,000 steps of reading the weights.
    load = type(fixed_load("1x1:1"))("mix", [100] * 100, [1000] + [10] * 99, [0.0] * 100, math.inf)
    kv = (1000 * (100 + 500) + 99 * 10 * (100 + 5)) * 1e5
    assert limits.load_seconds(load) == pytest.approx(100 * 100 / 1e4 + (1000 * 1e10 + kv) / 1e12)
    # A long request that is not the last to arrive still bounds the load by its own path from its arrival.
    early_long = type(load)("mix", [100, 100], [1000, 2], [5.0, 5.5], 2.0)
    alone = 5.0 + 100 / 1e4 + 999 * (1e10 + 100 * 1e5) / 1e12
    assert limits.load_seconds(early_long) == pytest.approx(alone)


@pytest.mark.slow
def test_serving_profile_runs_on_the_cpu_with_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    rc = bench_main(["--profile", "serving", "--shape", "tiny", "--device", "cpu", "--num-requests", "5",
                     "--rates", "20", "inf", "--fixed-loads", "3x12:3", "--input-len", "12", "--output-len", "3",
                     "--max-running-requests", "4", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())["serving"]
    assert [r["name"] for r in report["loads"]] == ["3x12:3", "sharegpt-like @ 20 req/s", "sharegpt-like @ inf req/s"]
    for r in report["loads"]:
        assert r["ok"] == r["requests"] and r["errors"] == []
        assert r["output_tokens"] > 0 and r["output_tok_s"] > 0
        assert r["bound_s"] > 0 and 0 < r["output_over_bound"] < math.inf
        assert 0 < r["ttft_s"]["p50"] <= r["latency_s"]["p99"]
        assert r["client"]["processes"] >= 1 and r["client"]["events"] >= r["output_tokens"]
    assert report["loads"][0]["output_tokens"] == 9  # 3 requests x 3 tokens, ignore_eos
    assert report["first_request"]["cold_s"] > 0 and report["first_request"]["warm_s"] > 0
    assert "2048" in report["limits"]["prefill_tok_s"]  # the runner alone at the step budget


def test_the_limits_time_the_step_an_engine_runs_prompts_of_each_length_packed_in() -> None:
    """The bound's prefill rate is the runner's packed step (four 512-token prompts in a 2,048 budget), not
    one short prompt alone, whose eager launches can take longer than its kernels."""
    assert packed(512, 2048) == 4 and packed(200, 2048) == 10 and packed(2048, 2048) == 1 and packed(4096, 2048) == 1
    limits = measure_limits("tiny", "cpu", [12, 48], max_batch=4, budget=48)
    assert sorted(limits.prefill_tok_s) == [12, 48] and min(limits.prefill_tok_s.values()) > 0
