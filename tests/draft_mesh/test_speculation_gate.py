"""The speculation gate: the engine speculates only while that measurably emits tokens faster, and
with its budget what speculating costs against plain decoding stays within it at any rate. Every gate
here runs on a fake clock that the helpers advance by each step's seconds (nothing sleeps)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest

from splitserve.draft_mesh.speculation_budget import CAP_STEPS, MARGIN, PROBE_FROM, RECOVER_S
from splitserve.draft_mesh.speculation_gate import (
    EARLY_STEPS,
    MAX_PROBE_EVERY,
    MAX_RETRY_S,
    MEASURE_STEPS,
    PLAIN,
    PROBE_AFTER_S,
    PROBE_EVERY,
    RETRY_S,
    SPECULATE,
    UNPRIMED_STEPS,
    WARMUP_STEPS,
    SpeculationGate,
)

STINT = WARMUP_STEPS + MEASURE_STEPS


class FakeClock:
    """The gate's clock: `now` seconds, moved by the helpers by each step's seconds (times `speed`:
    0 stops it, to see what the steps alone decide)."""

    def __init__(self, speed: float = 1.0) -> None:
        self.now, self.speed = 1000.0, speed

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += self.speed * seconds


def make_gate(speed: float = 1.0, **kwargs) -> SpeculationGate:
    return SpeculationGate(clock=FakeClock(speed), **kwargs)


def step(gate: SpeculationGate, bucket: int, tokens: int, seconds: float, verified: bool = False) -> str:
    """One step observed (the clock moves by its seconds), and the gate's decision for the next."""
    gate.clock.tick(seconds)
    gate.observe(bucket, tokens, seconds, verified=verified)
    return gate.decide()


def run(gate: SpeculationGate, steps: int, rates: dict[str, float], bucket: int = 8) -> list[str]:
    """`steps` steps, each emitting `bucket` tokens at the current mode's rate; the modes chosen."""
    return [step(gate, bucket, bucket, bucket / rates[gate.mode], verified=gate.mode == SPECULATE)
            for _ in range(steps)]


def test_both_modes_are_measured_first_and_the_faster_is_kept() -> None:
    gate = make_gate()
    modes = run(gate, STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[:-1] == [SPECULATE] * (STINT - 1) and modes[-1] == PLAIN  # measured; plain not yet: try it
    modes = run(gate, STINT + 20, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert set(modes) == {PLAIN}  # slower speculation stays off
    assert gate.rates == {(8, SPECULATE): pytest.approx(500.0), (8, PLAIN): pytest.approx(1000.0)}


def test_speculation_that_pays_is_kept_and_plain_is_probed_less_and_less_often() -> None:
    gate = make_gate()
    modes = run(gate, 2000, {SPECULATE: 1500.0, PLAIN: 1000.0})
    assert modes[-1] == SPECULATE
    assert modes.count(PLAIN) < 0.05 * len(modes)
    first, later = modes[:200].count(PLAIN), modes[-1000:].count(PLAIN)
    assert later < first * 5  # the probes thin out (1000 steps hold fewer probes than the first 200's rate)


def test_a_probe_finds_a_drafter_that_got_better() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert gate.mode == PLAIN
    modes = run(gate, 4 * PROBE_EVERY, {SPECULATE: 2000.0, PLAIN: 1000.0})
    switched = modes.index(SPECULATE)
    assert switched <= PROBE_EVERY + WARMUP_STEPS  # at the next probe
    assert modes[switched:].count(SPECULATE) >= 0.8 * len(modes[switched:])  # kept, but for short probes


def test_another_batch_bucket_is_measured_on_its_own_and_k0_forces_plain() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    run(gate, STINT, {SPECULATE: 4000.0, PLAIN: 1000.0}, bucket=1)
    assert (1, PLAIN) in gate.rates and (1, SPECULATE) not in gate.rates  # the stint went on in plain
    gate.force(PLAIN)
    gate.observe(1, 1, 0.001)
    assert gate.mode == PLAIN


def test_a_speculating_stint_counts_from_its_first_verify_step() -> None:
    gate = make_gate()
    gate.observe(8, 8, 0.001)  # plain-fast steps while the drafter has no drafts yet: not speculation's rate
    gate.observe(8, 8, 0.001)
    assert gate.stint.steps == 0 and gate.stint.waited == 2
    for _ in range(STINT):
        gate.observe(8, 8, 0.004, verified=True)
    assert gate.rates[(8, SPECULATE)] == pytest.approx(2000.0)
    stuck = make_gate()
    modes = [step(stuck, 8, 8, 0.01) for _ in range(UNPRIMED_STEPS)]  # a drafter that never drafts
    assert modes == [SPECULATE] * (UNPRIMED_STEPS - 1) + [PLAIN]  # ends, as "no drafts": no rate measured
    assert (8, SPECULATE) not in stuck.rates and stuck.switches == {"plain/no drafts": 1}


def test_a_probe_far_behind_ends_early() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    modes = run(gate, 3 * PROBE_EVERY, {SPECULATE: 500.0, PLAIN: 1000.0})
    probe = modes.index(SPECULATE)
    assert modes[probe:probe + WARMUP_STEPS + EARLY_STEPS] == [SPECULATE] * (WARMUP_STEPS + EARLY_STEPS)
    assert modes[probe + WARMUP_STEPS + EARLY_STEPS - 1] == SPECULATE and PLAIN in modes[probe:probe + STINT - 1]


def test_another_drafter_is_measured_again_before_either_mode_is_trusted() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 3000.0, PLAIN: 1000.0})  # a drafter that paid
    assert gate.mode == SPECULATE
    gate.force(PLAIN)  # K = 0 for a while (or a gate that went plain)
    run(gate, STINT, {SPECULATE: 3000.0, PLAIN: 1000.0})
    gate.forget_speculation()  # it left; a worse one joined
    assert (8, SPECULATE) not in gate.rates and (8, PLAIN) in gate.rates
    modes = run(gate, 3 * STINT, {SPECULATE: 300.0, PLAIN: 1000.0})
    assert modes[0] == SPECULATE  # measured at once, not trusted from the old drafter's rate
    assert modes[-1] == PLAIN and modes.count(SPECULATE) <= STINT


def test_speculating_that_lost_at_a_smaller_batch_waits_for_its_probe_at_a_larger_one() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=1)
    assert gate.mode == PLAIN
    modes = run(gate, PROBE_EVERY, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    assert set(modes) == {PLAIN}  # not tried at once at batch 8
    modes = run(gate, 2 * PROBE_EVERY + 2 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    assert SPECULATE in modes and modes[-1] == PLAIN  # but probed when due, and lost
    assert (8, SPECULATE) in gate.rates
    winner = make_gate()
    run(winner, 3 * STINT, {SPECULATE: 2000.0, PLAIN: 1000.0}, bucket=1)
    modes = run(winner, 2 * STINT, {SPECULATE: 2000.0, PLAIN: 1000.0}, bucket=8)
    assert modes[0] == SPECULATE  # it paid at batch 1: measured at once at batch 8


def test_steps_forced_plain_do_not_bring_the_next_probe_closer() -> None:
    gate = make_gate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert gate.mode == PLAIN
    for _ in range(3 * PROBE_EVERY):  # K = 0 for a long time
        gate.observe(8, 8, 0.008)
        gate.force(PLAIN)
    modes = run(gate, PROBE_EVERY - STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert set(modes) == {PLAIN}  # no probe as soon as K is back: the interval starts again


# ---- with the loss budget (--speculation-budget) ----


def test_plain_decoding_is_measured_first_then_speculating_and_the_faster_is_kept() -> None:
    gate = make_gate(budgeted=True)
    modes = run(gate, STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[:-1] == [PLAIN] * (STINT - 1) and modes[-1] == SPECULATE  # measured; speculating not yet: try it
    modes = run(gate, STINT + 20, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[0] == SPECULATE and set(modes[2:]) == {PLAIN}  # slower speculation stops, within its budget
    assert gate.rates == {(8, SPECULATE): pytest.approx(500.0), (8, PLAIN): pytest.approx(1000.0)}
    assert gate.switches == {"speculate/probe": 1, "plain/budget": 1}


def spend(gate: SpeculationGate, steps: int, speculating: Callable[[int], float], plain: float = 1000.0,
          bucket: int = 8, unprimed: int = 0) -> tuple[float, float, int]:
    """`steps` steps of `bucket` tokens: plain at `plain` tokens/s, the n-th step of a speculating
    stint at `speculating(n)`, verifying drafts from its (`unprimed` + 1)-th step on; (seconds taken,
    seconds plain decoding takes for those tokens, speculating steps)."""
    taken = tokens = n = speculated = 0
    for _ in range(steps):
        if gate.mode == SPECULATE:
            rate, n, speculated = speculating(n), n + 1, speculated + 1
        else:
            rate, n = plain, 0
        seconds = bucket / rate
        step(gate, bucket, bucket, seconds, verified=gate.mode == SPECULATE and n > unprimed)
        taken, tokens = taken + seconds, tokens + bucket
    return taken, tokens / plain, speculated


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("slow_start", [0, 3])
def test_speculating_that_does_not_pay_costs_at_most_its_budget(ratio, slow_start) -> None:
    # Speculating at `ratio` of plain decoding's rate (its drafts verified), each stint's first `slow_start`
    # steps at a third of it (a drafter's first, slow drafts): over any run the time lost against plain
    # decoding stays within MARGIN of it plus the cap and the one step that overdrew it, plus, for each
    # debt forgiven (RECOVER_S after its last charge, the wait doubling), half the cap and one step.
    # (Stints that verify no drafts at all are bounded by the gate's retry wait instead: see below.)
    gate = make_gate(budgeted=True)
    plain_step = 8 / 1000.0
    worst = 8 / (1000.0 * min(ratio, 1 / 3 if slow_start else 1.0)) - plain_step

    def bound(gate: SpeculationGate, plain_s: float) -> float:
        forgiven = gate.budgets[8].forgiven
        assert forgiven <= 1 + math.log2(1 + plain_s / RECOVER_S)  # the wait doubles
        return (plain_s * (1 + MARGIN) + CAP_STEPS * plain_step + worst
                + forgiven * (PROBE_FROM * CAP_STEPS * plain_step + worst) + 1e-9)

    for steps in (50, 200, 2000):
        short = make_gate(budgeted=True)
        taken, plain_s, _ = spend(short, steps, lambda n: 1000.0 * (ratio if n >= slow_start else 1 / 3))
        assert taken <= bound(short, plain_s), (steps, taken / plain_s)
    taken, plain_s, speculated = spend(gate, 5000, lambda n: 1000.0 * ratio)
    assert taken <= bound(gate, plain_s)  # 40 s: MARGIN in the long run, and a few forgiven debts
    assert speculated > 1  # it kept measuring (probes), spending what plain decoding saved


def test_a_stint_that_turns_bad_after_winning_long_ends_within_the_cap() -> None:
    gate = make_gate(budgeted=True)
    spend(gate, 2000, lambda n: 2000.0)
    assert gate.mode == SPECULATE and gate.budgets[8].headroom_s == pytest.approx(CAP_STEPS * 8 / 1000.0)
    saved = gate.budgets[8].saved_s
    taken, plain_s, speculated = spend(gate, 100, lambda n: 250.0)  # the drafter got bad
    assert gate.mode == PLAIN and speculated <= 2
    assert taken - plain_s <= CAP_STEPS * 8 / 1000.0 + 8 / 250.0
    assert gate.budgets[8].saved_s < saved


@pytest.mark.parametrize("clock_runs", [False, True])
def test_speculating_starts_again_only_with_headroom_saved_or_once_the_debt_is_old(clock_runs) -> None:
    gate = make_gate(budgeted=True, speed=1.0 if clock_runs else 0.0)
    spend(gate, STINT + 2, lambda n: 100.0)  # plain measured, then one speculating step far behind
    budget = gate.budgets[8]
    owed = budget.headroom_s
    assert gate.mode == PLAIN and owed < 0  # the step overdrew it: plain decoding pays it back first
    gate.rates[(8, SPECULATE)] = 5000.0  # even a rate that says speculating wins waits for the headroom
    steps = 0
    while gate.mode == PLAIN:
        spend(gate, 1, lambda n: 100.0)
        steps += 1
    earned = MARGIN * 8 / 1000.0  # a plain step's
    if not clock_runs:  # no time passes: only what the steps saved lets it start
        assert steps == pytest.approx((PROBE_FROM * budget.cap_s - owed) / earned, abs=1.5)
        assert budget.forgiven == 0
    else:  # the debt is forgiven RECOVER_S after its charge, long before the steps would have saved it
        assert steps == pytest.approx(RECOVER_S / (8 / 1000.0), abs=1.5)
        assert steps < (PROBE_FROM * budget.cap_s - owed) / earned / 2
        assert budget.forgiven == 1 and budget.recover_s == 2 * RECOVER_S
        assert budget.opened_s == pytest.approx(PROBE_FROM * budget.cap_s)  # it starts on half the cap


def test_speculating_starts_only_where_plain_is_measured_but_a_stint_the_batch_carries_goes_on() -> None:
    gate = make_gate(budgeted=True)
    gate.force(SPECULATE)  # e.g. the gate was off: speculating at a bucket with no plain rate
    gate.observe(8, 8, 0.001, verified=True)
    assert gate.decide() == PLAIN and gate.switches["plain/unmeasured"] == 1
    gate = make_gate(budgeted=True)
    spend(gate, 3 * STINT, lambda n: 3000.0, bucket=8)
    assert gate.mode == SPECULATE
    for _ in range(WARMUP_STEPS + MEASURE_STEPS - 1):  # the batch shrank (requests finished) to bucket 4
        gate.observe(4, 12, 0.004, verified=True)
        assert gate.decide() == SPECULATE
    assert "plain/unmeasured" not in gate.switches and "plain/budget" not in gate.switches
    assert gate.budgets[4].headroom_s is None and gate.budgets[4].saved_s == 0.0  # uncharged: no plain rate
    gate.observe(4, 12, 0.004, verified=True)  # its rate is measured: plain's is probed, as without a budget
    assert gate.decide() == PLAIN and gate.switches["plain/probe"] == 1


def test_a_batch_that_grows_into_a_bucket_without_a_plain_rate_decodes_plainly_there_first() -> None:
    gate = make_gate(budgeted=True)
    spend(gate, 3 * STINT, lambda n: 3000.0, bucket=8)
    assert gate.mode == SPECULATE
    gate.observe(16, 16, 0.004, verified=True)  # new requests joined (or a new burst after an idle spell)
    assert gate.decide() == PLAIN and gate.switches["plain/unmeasured"] == 1
    gate = make_gate()  # without the budget the rates alone decide: speculating goes on there
    spend(gate, 3 * STINT, lambda n: 3000.0, bucket=8)
    gate.observe(16, 16, 0.004, verified=True)
    assert gate.decide() == SPECULATE and "plain/unmeasured" not in gate.switches


def test_the_summary_says_what_the_gate_decided_and_why() -> None:
    gate = make_gate(budgeted=True)
    spend(gate, 3 * STINT, lambda n: 400.0)
    summary = gate.summary()
    assert summary["mode"] == PLAIN and summary["bucket"] == 8
    bucket = summary["buckets"]["8"]
    assert bucket["plain_tokens_per_s"] == pytest.approx(1000.0)
    assert bucket["speculate_tokens_per_s"] == pytest.approx(400.0)
    assert bucket["saved_ms"] < 0 and bucket["cap_ms"] == pytest.approx(1e3 * CAP_STEPS * 8 / 1000.0)
    assert bucket["probe_every"] == 2 * PROBE_EVERY
    assert summary["switches"] == {"speculate/probe": 1, "plain/budget": 1}
    assert gate.switched == [(SPECULATE, "probe"), (PLAIN, "budget")]


def test_the_plain_steps_right_after_speculating_are_charged_to_it_against_the_best_plain_rate() -> None:
    gate = make_gate(budgeted=True)
    run(gate, STINT, {SPECULATE: 250.0, PLAIN: 1000.0})  # plain measured at 1000 tok/s; speculating is tried
    while gate.mode == SPECULATE:
        gate.observe(8, 8, 8 / 250.0, verified=True)
        gate.decide()
    budget = gate.budgets[8]
    for n in range(WARMUP_STEPS + 1):  # slow plain steps (the drafter's last steps still on the device)
        before = budget.headroom_s
        gate.observe(8, 8, 8 / 500.0)
        gate.decide()
        charged = 8 / 500.0 - 8 / 1000.0 if n < WARMUP_STEPS else 0.0
        assert budget.headroom_s == pytest.approx(before + MARGIN * 8 / 500.0 - charged)
    for _ in range(MEASURE_STEPS):
        gate.observe(8, 8, 8 / 500.0)
        gate.decide()
    assert gate.rates[(8, PLAIN)] == pytest.approx(500.0)  # the latest plain stint measured low ...
    assert gate.plain_best[8] == pytest.approx(1000.0)  # ... speculating is still charged against 1000


def test_a_stints_first_steps_before_any_verify_end_it_only_once_the_budget_is_overdrawn() -> None:
    # The drafter's prefill of the requests costs the first step two plain steps' time; the drafts then pay.
    gate = make_gate(budgeted=True)
    run(gate, STINT, {SPECULATE: 1000.0, PLAIN: 1000.0})
    assert gate.mode == SPECULATE and gate.stint.steps == 0
    gate.observe(8, 8, 3 * 8 / 1000.0)  # no drafts yet: 16 ms lost of the 24 ms cap
    assert gate.decide() == SPECULATE  # the loss of a step without drafts does not predict the next ones
    for _ in range(20):
        gate.observe(8, 24, 8 / 1000.0, verified=True)  # three tokens a request in a plain step's time
        assert gate.decide() == SPECULATE
    assert gate.budgets[8].headroom_s == pytest.approx(gate.budgets[8].cap_s)
    assert gate.budgets[8].saved_s > 0


def test_a_plain_stint_that_ends_early_still_gives_its_bucket_the_plain_step_time() -> None:
    # Speculating measured first, then plain decoding clearly slower after EARLY_STEPS: the stint ends early, and
    # its rate is the bucket's plain rate; the bucket's budget takes its step time too (cap, headroom) and the
    # summary shows them, as after a stint of MEASURE_STEPS.
    gate = make_gate()
    run(gate, STINT, {SPECULATE: 1000.0, PLAIN: 1000.0})
    assert gate.mode == PLAIN
    modes = run(gate, WARMUP_STEPS + EARLY_STEPS, {SPECULATE: 1000.0, PLAIN: 400.0})
    assert modes[-1] == SPECULATE  # ended early: clearly slower
    assert gate.rates[(8, PLAIN)] == pytest.approx(400.0)
    budget = gate.budgets[8]
    assert budget.cap_s == pytest.approx(CAP_STEPS * 8 / 400.0) and budget.headroom_s is not None
    summary = gate.summary()["buckets"]["8"]
    assert summary["cap_ms"] == pytest.approx(1e3 * CAP_STEPS * 8 / 400.0) and summary["headroom_ms"] is not None
    assert gate.plain_best[8] == pytest.approx(400.0)


# ---- stints without drafts, warm-up artefacts and old evidence (every clock here is the fake one) ----


def drive(gate: SpeculationGate, seconds: float, plain: float, speculating: Callable[[float], float],
          drafts_from: float = 0.0, bucket: int = 1, no_drafts_cost: float = 1.1) -> list[tuple[float, str, bool]]:
    """A verifier's loop for `seconds` of decoding, from its start: plain steps at `plain` tokens/s;
    speculating steps verify drafts once `drafts_from` seconds have passed (the drafter has taken the requests
    in) and then emit at `speculating(t)` tokens/s (t: seconds since the start), before that at plain's rate
    `no_drafts_cost` times slower (no overlap scheduler). Each step's (t, mode, verified). (t is the steps'
    own seconds, whatever the gate's clock shows.)"""
    t, log = 0.0, []
    while t < seconds:
        mode = gate.mode
        verified = mode == SPECULATE and t >= drafts_from
        rate = speculating(t) if verified else plain / (no_drafts_cost if mode == SPECULATE else 1.0)
        step(gate, bucket, bucket, bucket / rate, verified=verified)
        log.append((t, mode, verified))
        t += bucket / rate
    return log


def test_a_cold_start_whose_drafts_arrive_late_ends_up_speculating() -> None:
    # Default flags (budget on), batch 1: plain decoding at 150 tokens/s, speculating with an exact drafter at
    # 2.1x, but the drafter, joined just before the load, sends its first drafts only 0.3 s in (before the
    # fix its first probe measured no drafts as a loss, and speculation stayed off for the run: 1.00x).
    gate = make_gate(budgeted=True)
    log = drive(gate, 3.0, 150.0, lambda t: 315.0, drafts_from=0.3)
    assert gate.switches.get("plain/no drafts", 0) >= 1  # the probes before the drafts came
    assert "plain/probe lost" not in gate.switches and "plain/budget" not in gate.switches
    assert gate.rates[(1, SPECULATE)] > 2 * gate.rates[(1, PLAIN)] and gate.mode == SPECULATE
    first = next(t for t, _, verified in log if verified)
    assert first <= 2 * 0.3 + 0.1  # the retry waits double from RETRY_S: at most about the delay itself late
    after = [mode for t, mode, _ in log if t >= first]
    assert after.count(SPECULATE) >= 0.9 * len(after)  # then kept (but for short probes of plain decoding)
    tokens = len(log)  # one token a step each; what 3 s of plain decoding at 150 tokens/s would have given:
    assert tokens / (150.0 * 3.0) >= 1.7  # most of the 2.1x, from a cold start


@pytest.mark.parametrize("budgeted", [False, True])
def test_a_probe_that_got_no_drafts_is_no_loss_and_is_retried_after_growing_waits(budgeted) -> None:
    gate = make_gate(budgeted=budgeted)
    clock, plain_step = gate.clock, 8 / 1000.0
    if budgeted:
        run(gate, STINT, {SPECULATE: 1000.0, PLAIN: 1000.0})  # plain measured; speculating is probed
    assert gate.mode == SPECULATE
    opened = gate._budget(8).headroom_s
    modes = [step(gate, 8, 8, 1.1 * plain_step) for _ in range(UNPRIMED_STEPS)]  # no drafts (no overlap: slower)
    assert modes == [SPECULATE] * (UNPRIMED_STEPS - 1) + [PLAIN] and gate.switches["plain/no drafts"] == 1
    assert (8, SPECULATE) not in gate.rates  # no evidence: no rate, not a lost probe
    assert gate.probe_every.get(8, PROBE_EVERY) == PROBE_EVERY and not gate.lost_at
    if budgeted:  # its charges come back to the headroom (what it cost is still accounted)
        assert gate.budgets[8].headroom_s == pytest.approx(opened) and gate.budgets[8].saved_s < 0
    for wait in (RETRY_S, 2 * RETRY_S, 4 * RETRY_S):
        assert gate.retry_at == pytest.approx(clock.now + wait)
        clock.speed = 0.0  # any number of steps in no time: no retry before its wait
        assert set(run(gate, 3 * PROBE_EVERY, {SPECULATE: 1000.0, PLAIN: 1000.0})) == {PLAIN}
        clock.speed, clock.now = 1.0, gate.retry_at
        assert step(gate, 8, 8, plain_step) == SPECULATE  # due: tried again at once
        # The drafter prefills the requests on the same device: steps three times as slow, still no drafts.
        # With the budget the stint ends before its steps would overdraw it, as "no drafts" still.
        while gate.mode == SPECULATE:
            step(gate, 8, 8, 3 * plain_step)
        assert gate.switched[-1] == (PLAIN, "no drafts") and (8, SPECULATE) not in gate.rates
        if budgeted:
            assert gate.budgets[8].headroom_s == pytest.approx(opened)
    assert gate.retry_at == pytest.approx(clock.now + 8 * RETRY_S)
    clock.now = gate.retry_at
    modes = run(gate, 3 * STINT, {SPECULATE: 3000.0, PLAIN: 1000.0})  # now it drafts, and pays
    assert modes[-1] == SPECULATE and gate.rates[(8, SPECULATE)] == pytest.approx(3000.0)
    assert gate.retry_s == RETRY_S and "plain/probe lost" not in gate.switches
    gate.retry_s = MAX_RETRY_S
    for _ in range(10):  # the wait grows no further than MAX_RETRY_S
        gate._no_drafts(gate.budgets[8])
        assert gate.retry_at == pytest.approx(clock.now + MAX_RETRY_S)


@pytest.mark.parametrize("budgeted", [False, True])
def test_a_drafter_that_loses_is_turned_off_and_probed_again_after_growing_intervals(budgeted) -> None:
    # Its drafts are verified (and mostly rejected): speculating emits half of plain decoding's rate.
    gate = make_gate(budgeted=budgeted)
    probes, steps, speculated = [], 0, 0
    while gate.clock.now - 1000.0 < 60.0:
        mode = gate.mode
        step(gate, 8, 8, 8 / (500.0 if mode == SPECULATE else 1000.0), verified=mode == SPECULATE)
        probes += [gate.clock.now for m, why in gate.switched if m == SPECULATE and why == "probe"]
        gate.switched.clear()
        steps, speculated = steps + 1, speculated + (mode == SPECULATE)
    assert gate.mode == PLAIN and speculated < 0.02 * steps
    assert "plain/no drafts" not in gate.switches and gate.rates[(8, SPECULATE)] < gate.rates[(8, PLAIN)]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(gaps) >= 3  # it keeps being probed ...
    assert all(later >= 0.9 * earlier for earlier, later in itertools.pairwise(gaps))  # ... less and less often
    assert gaps[-1] >= 4 * gaps[0]
    assert gaps[-1] <= PROBE_AFTER_S * MAX_PROBE_EVERY / PROBE_EVERY + 1.0  # but within a bounded time


def test_the_budget_recovers_after_a_warm_up_artefact() -> None:
    # The first probe verified drafts, but the drafter's first steps were slow (a warm-up artefact): the stint
    # lost and overdrew the budget. Then the drafter is warm (2.5x): speculating is on again within about
    # RECOVER_S, though the steps alone would have taken hundreds to save the headroom back.
    gate = make_gate(budgeted=True)
    log = drive(gate, 4.0, 1000.0, lambda t: 100.0 if t < 0.08 else 2500.0, bucket=8)
    assert gate.switches.get("plain/budget", 0) + gate.switches.get("plain/probe lost", 0) >= 1
    lost = next(t for t, mode, _ in log if t > 0.05 and mode == PLAIN)
    back = next(t for t, mode, _ in log if t > lost and mode == SPECULATE)
    assert back - lost <= RECOVER_S + 2 * STINT * 8 / 1000.0 + 0.1
    assert gate.budgets[8].forgiven == 1 and gate.mode == SPECULATE
    after = [mode for t, mode, _ in log if t >= back]
    assert after.count(SPECULATE) >= 0.9 * len(after)
    frozen = make_gate(budgeted=True, speed=0.0)  # no time passing: only saved headroom lets it start
    log = drive(frozen, 4.0, 1000.0, lambda t: 100.0 if t < 0.08 else 2500.0, bucket=8)
    assert frozen.budgets[8].forgiven == 0


def test_speculating_that_lost_is_probed_again_after_a_bounded_time_while_the_batch_keeps_moving() -> None:
    # Speculating lost at batch bucket 8; then the batch moves between buckets 8 and 16 every 30 steps: each move
    # starts a new stint, which never reaches the probe interval in steps. It is probed again once
    # PROBE_AFTER_S (x the interval) has passed since it lost.
    rates = {SPECULATE: 500.0, PLAIN: 1000.0}
    for speed in (1.0, 0.0):
        gate = make_gate(budgeted=True, speed=speed)
        run(gate, 3 * STINT, rates)
        assert gate.mode == PLAIN and gate.switches["plain/budget"] == 1
        lost, every, probed = gate.lost_at[8], gate.probe_every[8], None
        gate.switched.clear()
        for i in range(100):
            bucket = 16 if i % 2 else 8
            for _ in range(30):
                step(gate, bucket, bucket, bucket / rates[gate.mode], verified=gate.mode == SPECULATE)
                if probed is None and any(mode == SPECULATE for mode, _ in gate.switched):
                    probed = gate.clock.now
        if speed:
            assert probed is not None and probed - lost >= PROBE_AFTER_S * every / PROBE_EVERY
            assert probed - lost <= PROBE_AFTER_S * every / PROBE_EVERY + STINT * 16 / 1000.0
        else:
            assert probed is None  # the steps alone never bring it (each move of the batch starts a stint)
