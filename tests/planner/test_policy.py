"""The planner's decisions on hand-made observations: a breach scales the breaching role, an idle pool switches
to the breaching one, headroom scales down only after the hysteresis window, and min/max always hold."""

from __future__ import annotations

import math

import pytest

from splitserve.planner.policy import (
    DECODE,
    PREFILL,
    SLO,
    Observation,
    PlannerConfig,
    RoleLimits,
    SLOPlanner,
    erlang_c,
    plan_switches,
    wait_quantile,
)

INTERVAL = 15.0


def obs(t: float, rate: float, p: int, d: int, *, ttft: float | None = 1.0, itl: float | None = 0.015,
        queue: int = 0, running: int = 10, kv: float = 0.2, prompt: float = 8000, output: float = 1000,
        ready: dict[str, int] | None = None) -> Observation:
    return Observation(time_s=t, ttft_s=ttft, itl_s=itl, prefill_queue_tokens=queue,
                       running_decodes=[running] * d, kv_usage=[kv] * d, arrival_rate=rate, prompt_tokens=prompt,
                       output_tokens=output, replicas={PREFILL: p, DECODE: d}, ready=ready)


def planner(**kw: object) -> SLOPlanner:
    limits = kw.pop("limits", {PREFILL: RoleLimits(1, 16), DECODE: RoleLimits(1, 16)})
    return SLOPlanner(PlannerConfig(slo=SLO(3.0, 0.030, 0.9), limits=limits, interval_s=INTERVAL, **kw))  # type: ignore[arg-type]


def feed(pl: SLOPlanner, rate: float, p: int, d: int, n: int, t0: float = 0.0, **kw: object):
    decisions = []
    for i in range(n):
        decisions.append(pl.decide(obs(t0 + (i + 1) * INTERVAL, rate, p, d, **kw)))  # type: ignore[arg-type]
    return decisions


def test_erlang_c_and_wait_quantile() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(4, 0) == 0 and erlang_c(2, 3) == 1
    assert wait_quantile(1, 2.0, 1.0, 0.9) == float("inf")
    # M/M/1 at rho 0.5, mu 1: P(W > t) = 0.5 exp(-0.5 t) = 0.1 -> t = 2 ln 5
    assert wait_quantile(1, 0.5, 1.0, 0.9) == pytest.approx(2 * math.log(5))


def test_prefill_breach_scales_prefill() -> None:
    pl = planner()
    feed(pl, 1.0, 2, 1, 4)  # steady at 1 req/s: 2P1D is enough
    d = pl.decide(obs(5 * INTERVAL, 1.0, 2, 1, ttft=6.0, queue=64_000))
    assert d.replicas[PREFILL] > 2 and d.replicas[DECODE] == 1
    change = next(c for c in d.changes if c.role == PREFILL)
    assert "scale up" in change.reason and "TTFT" in change.reason


def test_load_rise_scales_both_roles_by_model() -> None:
    pl = planner()
    feed(pl, 1.0, 2, 1, 4)
    d = pl.decide(obs(5 * INTERVAL, 8.0, 2, 1))
    assert d.replicas[PREFILL] >= 6 and d.replicas[DECODE] >= 3
    assert all(c.reason.startswith("scale up") for c in d.changes)


def test_itl_breach_scales_decode() -> None:
    pl = planner()
    feed(pl, 2.0, 3, 2, 4)
    d = pl.decide(obs(5 * INTERVAL, 2.0, 3, 2, itl=0.045))
    assert d.replicas[DECODE] == 3 and d.replicas[PREFILL] == 3
    assert "ITL" in d.changes[0].reason


def test_breach_not_repeated_while_a_pod_is_starting() -> None:
    pl = planner()
    feed(pl, 2.0, 3, 3, 4)
    d = pl.decide(obs(5 * INTERVAL, 2.0, 3, 3, itl=0.045, ready={PREFILL: 3, DECODE: 2}))
    assert d.replicas[DECODE] == 3  # the one starting is the answer: no second one for the same breach


def test_idle_prefill_breaching_decode_prefers_switch() -> None:
    pl = planner()
    # Short prompts and long outputs now: 6 prefill replicas mostly idle, decode over its ITL target.
    feed(pl, 6.0, 6, 2, 4, prompt=300, output=600, running=150, kv=0.2, itl=0.02)
    d = pl.decide(obs(5 * INTERVAL, 6.0, 6, 2, prompt=300, output=600, running=150, kv=0.2, itl=0.045))
    assert d.prefer_switch
    sw = d.switches[0]
    assert (sw.from_role, sw.to_role) == (PREFILL, DECODE) and sw.count >= 1
    assert d.replicas[DECODE] > 2 and d.replicas[PREFILL] == 6 - sw.count
    assert d.replicas[PREFILL] >= 1
    dec = next(c for c in d.changes if c.role == DECODE)
    assert dec.via_switch == sw.count and "switch" in sw.reason


def test_no_switch_when_the_other_pool_is_busy() -> None:
    pl = planner()
    feed(pl, 8.0, 7, 3, 4)
    d = pl.decide(obs(5 * INTERVAL, 8.0, 7, 3, itl=0.045))
    assert not d.prefer_switch and d.replicas[DECODE] >= 4 and d.replicas[PREFILL] >= 7


def test_scale_down_only_after_sustained_headroom() -> None:
    pl = planner(scale_down_intervals=4)
    feed(pl, 8.0, 8, 4, 8)  # at the peak: steady
    decisions = feed(pl, 1.0, 8, 4, 8, t0=8 * INTERVAL)  # the load drops and stays low
    downs = [i for i, d in enumerate(decisions) if d.replicas[PREFILL] < 8]
    assert downs, "never scaled down"
    first = downs[0]
    assert first >= 3  # not before four intervals of headroom (and not while the fitted trend still falls)
    assert all(d.replicas[PREFILL] == 8 for d in decisions[:first])
    assert decisions[first].replicas[PREFILL] < 8
    assert "scale down" in next(c.reason for c in decisions[first].changes if c.role == PREFILL)


def test_a_blip_of_headroom_does_not_scale_down() -> None:
    pl = planner(scale_down_intervals=4)
    cur = {PREFILL: 1, DECODE: 1}
    t = 0.0
    for _ in range(20):  # steady at 4 req/s: converge on the planner's own answer
        t += INTERVAL
        cur = pl.decide(obs(t, 4.0, cur[PREFILL], cur[DECODE])).replicas
    steady = dict(cur)
    for rate in [1.0] * 3 + [4.0] * 8:  # three quiet intervals, fewer than the window: no scale-down
        t += INTERVAL
        cur = pl.decide(obs(t, rate, cur[PREFILL], cur[DECODE])).replicas
        assert cur[PREFILL] >= steady[PREFILL] and cur[DECODE] >= steady[DECODE]


def test_min_and_max_respected() -> None:
    limits = {PREFILL: RoleLimits(2, 4), DECODE: RoleLimits(2, 3)}
    pl = planner(limits=limits)
    for d in feed(pl, 20.0, 2, 2, 6, ttft=30.0, itl=0.1, queue=500_000):
        assert 2 <= d.replicas[PREFILL] <= 4 and 2 <= d.replicas[DECODE] <= 3
    assert d.replicas[PREFILL] == 4 and d.replicas[DECODE] == 3
    pl = planner(limits=limits)
    for d in feed(pl, 0.0, 4, 3, 20, ttft=None, itl=None, running=0, kv=0.0):
        assert d.replicas[PREFILL] >= 2 and d.replicas[DECODE] >= 2
    assert d.replicas == {PREFILL: 2, DECODE: 2}
    # A switch never takes the donor under its minimum nor the receiver over its maximum.
    pl = planner(limits={PREFILL: RoleLimits(5, 8), DECODE: RoleLimits(1, 3)})
    feed(pl, 6.0, 6, 2, 4, prompt=300, output=600, running=150)
    d = pl.decide(obs(5 * INTERVAL, 6.0, 6, 2, prompt=300, output=600, running=150, itl=0.045))
    assert d.replicas[PREFILL] >= 5 and d.replicas[DECODE] <= 3


def test_plan_switches_takes_the_shortfall_from_the_idle_role_only_down_to_its_need_and_minimum() -> None:
    limits = {PREFILL: RoleLimits(2, 8), DECODE: RoleLimits(1, 8)}
    current = {PREFILL: 6, DECODE: 2}
    # Decode short by 3, prefill idle: needs 2 (its minimum too) of its 6, so 3 of the 4 spare switch.
    sw = plan_switches({PREFILL: 6, DECODE: 5}, current, {PREFILL: 2, DECODE: 5}, limits, 120.0)
    assert [(s.from_role, s.to_role, s.count) for s in sw] == [(PREFILL, DECODE, 3)]
    # Short by more than the idle surplus: only the surplus switches (the rest are new pods).
    sw = plan_switches({PREFILL: 6, DECODE: 9}, current, {PREFILL: 4, DECODE: 9}, limits, 120.0)
    assert [(s.from_role, s.count) for s in sw] == [(PREFILL, 2)]
    # The minimum bounds the donor even when its need is lower.
    assert plan_switches({PREFILL: 2, DECODE: 3}, {PREFILL: 2, DECODE: 2}, {PREFILL: 1, DECODE: 3}, limits,
                         120.0) == []
    # No shortfall, or no idle donor: nothing.
    assert plan_switches(current, current, {PREFILL: 2, DECODE: 2}, limits, 120.0) == []
    assert plan_switches({PREFILL: 6, DECODE: 4}, current, {PREFILL: 6, DECODE: 4}, limits, 120.0) == []
