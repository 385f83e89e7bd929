"""bench --profile phases: its burst's spec, requests and figures, and the report's burst line (no servers)."""

from __future__ import annotations

import pytest

from splitserve.bench.phases import (
    PhasesBenchConfig,
    Sample,
    burst_requests,
    counter_total,
    print_phases_report,
    summarize_burst,
    workload,
)
from splitserve.bench.serving import fixed_load, parse_fixed_load


def test_a_burst_spec_is_parsed_and_a_bad_one_says_what_it_expects() -> None:
    assert parse_fixed_load("256x512:256") == (256, 512, 256)
    for bad in ("256x512", "x512:4", "2x0:4", "ax1:2"):
        with pytest.raises(ValueError, match=r"--burst .*(expected NxI:O|must be >= 1)"):
            burst_requests(bad, vocab=300, seed=0)
        with pytest.raises(ValueError, match="--fixed-loads"):  # the serving bench's loads say the same
            fixed_load(bad)
    requests = burst_requests("3x5:7", vocab=300, seed=0)
    assert [(t, len(p), o) for t, p, o in requests] == [(0.0, 5, 7)] * 3
    assert all(10 <= i < 300 for _, p, _ in requests for i in p) and requests == burst_requests("3x5:7", 300, 0)


def test_each_part_of_the_load_has_prompts_of_its_own() -> None:
    """The warm-up, each rate and the burst share no prompt (a later rate would find an earlier one's prompts in
    the prefix cache), and each part is the same from one run to the next."""
    cfg = PhasesBenchConfig(num_requests=20, input_lens=[8, 16], output_lens=[2, 4])
    parts = {part: workload(cfg, 300, part) for part in ("warmup", "rate0", "rate1")}
    parts["burst"] = burst_requests("20x12:3", 300, cfg.seed)
    prompts = {part: {tuple(p) for _, p, _ in load} for part, load in parts.items()}
    assert all(len(found) == 20 for found in prompts.values())
    assert sum(len(found) for found in prompts.values()) == len(set().union(*prompts.values()))
    assert workload(cfg, 300, "rate0") == parts["rate0"] and len(workload(cfg, 300, "warmup", 5)) == 5
    offsets = [t for t, _, _ in parts["rate1"]]
    assert offsets == sorted(offsets) and all(8 <= len(p) <= 16 and 2 <= o <= 4 for _, p, o in parts["rate1"])


def test_preemptions_are_read_from_an_engine_s_metrics() -> None:
    from prometheus_client import generate_latest

    from splitserve.engine.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    assert counter_total(generate_latest(metrics.registry).decode(), "splitserve_preemptions") == 0
    metrics.preemptions.inc(3)
    text = generate_latest(metrics.registry).decode()
    assert counter_total(text, "splitserve_preemptions") == 3
    assert counter_total(text, "splitserve_no_such_counter") == 0


def test_a_burst_counts_the_tokens_received_over_its_whole_span(capsys) -> None:
    samples = [Sample(0.5, None, tokens=100), Sample(1.5, None, tokens=100), Sample(0.0, None, "HTTP 503")]
    burst = summarize_burst(samples, seconds=4.0)
    assert burst["output_tok_s"] == 50.0 and (burst["ok"], burst["requests"]) == (2, 3)
    assert burst["errors"] == ["HTTP 503"] and burst["ttft_s"]["p50"] == pytest.approx(1.0, abs=0.5)
    faster = summarize_burst([Sample(0.2, None, tokens=100)] * 2, seconds=2.0)
    print_phases_report({"config": {"rates": [], "burst": "2x8:100"}, "unified": {"burst": burst},
                         "1p1d": {"burst": faster}})
    out = capsys.readouterr().out
    assert "output 50 tok/s unified, 100 1P1D (2.00x)" in out and "(2/3 and 2/2 ok)" in out


def test_a_report_of_one_deployment_prints_its_own_figures(capsys) -> None:
    """--deployments 1p1d: each rate's TTFT and phases of that deployment alone, and its burst."""
    rate = {"requests": 4, "ok": 4, "with_phases": 4, "ttft_s": {"p50": 0.08}, "attributed_p50": 0.99,
            "itl_s": {"p50": 0.012, "p99": 0.031},
            "attributed_min": 0.97, "phases_p50_s": {"transfer": 0.002, "kv_notice": 0.004}, "preemptions": {}}
    burst = summarize_burst([Sample(0.2, None, tokens=100)] * 2, seconds=2.0)
    print_phases_report({"config": {"rates": [8.0], "burst": "2x8:100"}, "unified": {},
                         "1p1d": {8.0: rate, "burst": burst}})
    out = capsys.readouterr().out
    assert "rate 8 req/s: TTFT p50 1P1D 80.0 ms (4/4 ok)" in out and "unified" not in out
    assert "        transfer      2.00 ms" in out and "kv_notice      4.00 ms" in out
    assert "ITL p50 / p99: 1P1D 12.0 / 31.0 ms" in out
    assert "output 100 tok/s 1P1D; TTFT p50 0.20 s (2/2 ok)" in out
    with pytest.raises(ValueError, match="--deployments takes unified and/or 1p1d"):
        from splitserve.bench.phases import run_phases_benchmark
        run_phases_benchmark(PhasesBenchConfig(deployments=["2p2d"]))


@pytest.mark.slow
def test_the_bench_runs_both_deployments_and_reports_every_request(capsys) -> None:
    """The whole profile on the CPU with the tiny model: a rate and a burst through each deployment."""
    from splitserve.bench.phases import run_phases_benchmark

    cfg = PhasesBenchConfig(model="tiny", device="cpu", rates=[4.0], num_requests=12, input_lens=[16, 64],
                            output_lens=[4, 16], burst="4x32:8", warmup_requests=4)
    report = run_phases_benchmark(cfg)
    for name in ("unified", "1p1d"):
        at_rate, burst = report[name][4.0], report[name]["burst"]
        assert (at_rate["ok"], at_rate["with_phases"]) == (12, 12), at_rate
        assert set(at_rate["preemptions"]) == ({"unified-0"} if name == "unified" else {"prefill-0", "decode-0"})
        assert burst["ok"] == 4 and burst["output_tok_s"] > 0
        assert 0 < at_rate["itl_s"]["p50"] <= at_rate["itl_s"]["p99"]  # gaps between the tokens each client got
    assert report["mps_gpus"] == {"unified": [], "1p1d": []}  # the CPU: no GPU to share
    assert {"transfer", "kv_notice", "decode_admission"} <= set(report["1p1d"][4.0]["phases_p50_s"])
    print_phases_report(report)
    out = capsys.readouterr().out
    assert "1P1D engines: no MPS (--mps auto)" in out and "unified " in out and " ms (12/12 ok), 1P1D " in out
