"""The simulator against arithmetic, the planner on the dynamo-10528 trace against the best static split, and many
scale-downs and role switches losing no request."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from splitserve.planner.policy import DECODE, PREFILL, SLO, Decision, Observation, RoleSwitch
from splitserve.planner.service_model import default_model
from splitserve.planner.simulator import GroupConfig, best_static, main, planner_for, simulate
from splitserve.planner.traces import TraceRequest, dynamo_10528, oscillating_trace

MODEL = default_model()
SLO_ = SLO(3.0, 0.030, 0.9)


def test_one_request_matches_the_model() -> None:
    res = simulate([TraceRequest(1.0, 4000, 101)], MODEL, GroupConfig(1, 1), SLO_)
    (r,) = res.requests
    assert r.ttft == pytest.approx(MODEL.prefill.seconds(4000) + 0.05)
    # 100 decode steps of a batch of one whose context grows from 4001 tokens.
    steps = sum(MODEL.decode.step_seconds(1, 4001 + j) for j in range(100))
    assert r.itl == pytest.approx(steps / 100)
    assert res.lost == 0 and res.gpu_hours == pytest.approx(2 * r.finish / 3600)


def test_decode_batches_stepped_arithmetically_match_stepping() -> None:
    # Three requests joining one decode engine mid-step, against a step-by-step reference.
    trace = [TraceRequest(0.0, 1000, 50), TraceRequest(0.2, 1000, 30), TraceRequest(0.23, 2000, 40)]
    res = simulate(trace, MODEL, GroupConfig(3, 1), SLO_)
    landed = sorted((r.first_token, r.rid, r) for r in res.requests)
    t, running, join_at = 0.0, {}, {r.rid: ft for ft, _, r in landed}
    finish: dict[int, float] = {}
    pending = dict(join_at)
    t = min(pending.values())
    while pending or running:
        for rid in [k for k, v in pending.items() if v <= t]:
            r = res.requests[rid]
            running[rid] = [r.prompt + 1, r.output - 1]
            del pending[rid]
        if not running:
            t = min(pending.values())
            continue
        t += MODEL.decode.step_seconds_sum(len(running), sum(c for c, _ in running.values()))
        for rid in list(running):
            running[rid][0] += 1
            running[rid][1] -= 1
            if running[rid][1] == 0:
                finish[rid] = t
                del running[rid]
    for r in res.requests:
        assert r.finish == pytest.approx(finish[r.rid], rel=1e-9)


def test_planner_on_dynamo_10528_meets_goodput_within_gpu_budget() -> None:
    trace = dynamo_10528(seed=0)
    group = GroupConfig(1, 1, startup_s=120.0, switch_s=5.0, interval_s=15.0)
    res = simulate(trace, MODEL, group, SLO_, planner_for(group, SLO_, MODEL))
    static = best_static(trace, MODEL, SLO_, group=group)
    assert static is not None
    assert res.lost == 0
    assert res.goodput >= 0.90, res.goodput
    assert static.result.goodput >= 0.90
    assert res.gpu_hours <= 1.15 * static.result.gpu_hours, (res.gpu_hours, static.prefill, static.decode,
                                                              static.result.gpu_hours)
    # The search found the cheapest: one replica fewer of either role misses the goodput target.
    for p, d in ((static.prefill - 1, static.decode), (static.prefill, static.decode - 1)):
        if p >= 1 and d >= 1:
            assert simulate(trace, MODEL, GroupConfig(p, d), SLO_).goodput < 0.90


def test_oscillating_load_scale_downs_lose_no_request() -> None:
    trace = oscillating_trace(2400.0, 60.0, seed=0)
    group = GroupConfig(2, 2, startup_s=20.0, switch_s=5.0, interval_s=5.0)
    pl = planner_for(group, SLO_, MODEL, scale_down_intervals=2, trend_intervals=4, down_horizon_s=0.0)
    res = simulate(trace, MODEL, group, SLO_, pl)
    removals = sum(e.count for e in res.events if e.kind in ("down", "cancel", "switch"))
    assert removals >= 100, removals
    assert res.completed == len(trace) and res.lost == 0
    assert all(r.prefills == 1 and r.decoded == r.output for r in res.requests)


class Alternator:
    """Switches one engine across every interval, alternating direction, and scales down every third interval."""

    def __init__(self) -> None:
        self.n = 0

    def decide(self, obs: Observation) -> Decision:
        self.n += 1
        cur = dict(obs.replicas)
        src, dst = (PREFILL, DECODE) if self.n % 2 else (DECODE, PREFILL)
        switches = []
        if cur[src] > 1:
            cur[src] -= 1
            cur[dst] += 1
            switches.append(RoleSwitch(src, dst, 1, "test"))
        if self.n % 3 == 0 and cur[dst] > 2:
            cur[dst] -= 1
        elif self.n % 3 == 1:
            cur[src] += 1
        return Decision(cur, [], switches, obs.arrival_rate)


def test_many_switches_drain_and_lose_nothing() -> None:
    trace = oscillating_trace(900.0, 30.0, seed=1)
    group = GroupConfig(3, 3, startup_s=20.0, switch_s=5.0, interval_s=5.0)
    res = simulate(trace, MODEL, group, SLO_, Alternator())
    switches = sum(e.count for e in res.events if e.kind == "switch")
    downs = sum(e.count for e in res.events if e.kind in ("down", "cancel"))
    assert switches + downs >= 100, (switches, downs)
    assert switches >= 50
    assert res.completed == len(trace) and res.lost == 0
    assert math.isfinite(res.gpu_hours) and res.gpu_hours > 0


def test_static_search_and_gpu_hours_count_starting_pods() -> None:
    trace = [TraceRequest(float(i), 2000, 50) for i in range(60)]
    group = GroupConfig(1, 1, startup_s=120.0, interval_s=10.0)

    class UpOnce:
        def decide(self, obs: Observation) -> Decision:
            return Decision({PREFILL: 2, DECODE: 1}, [], [], 0.0)

    res = simulate(trace, MODEL, group, SLO_, UpOnce())
    # Two pods serve throughout; the third counts from its ask at t=10 though it never serves before the end.
    assert res.gpu_hours == pytest.approx((2 * res.end_s + (res.end_s - 10.0)) / 3600)
    static = best_static(trace, MODEL, SLO_)
    assert static is not None and (static.prefill, static.decode) == (1, 1)


def test_cli_prints_and_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.png"
    assert main(["--trace", "dynamo-10528", "--png", str(out)]) == 0
    text = capsys.readouterr().out
    assert "planner:" in text and "static:" in text and "GPU-hours" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
