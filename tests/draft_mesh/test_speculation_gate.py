"""The speculation gate: the engine speculates only while that measurably emits tokens faster, and
with its budget what speculating costs against plain decoding stays within it at any rate."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve.draft_mesh.speculation_budget import CAP_STEPS, MARGIN, PROBE_FROM
from splitserve.draft_mesh.speculation_gate import (
    EARLY_STEPS,
    MEASURE_STEPS,
    PLAIN,
    PROBE_EVERY,
    SPECULATE,
    UNPRIMED_STEPS,
    WARMUP_STEPS,
    SpeculationGate,
)

STINT = WARMUP_STEPS + MEASURE_STEPS


def run(gate: SpeculationGate, steps: int, rates: dict[str, float], bucket: int = 8) -> list[str]:
    """`steps` steps, each emitting `bucket` tokens at the current mode's rate; the modes chosen."""
    modes = []
    for _ in range(steps):
        gate.observe(bucket, bucket, bucket / rates[gate.mode], verified=gate.mode == SPECULATE)
        modes.append(gate.decide())
    return modes


def test_both_modes_are_measured_first_and_the_faster_is_kept() -> None:
    gate = SpeculationGate()
    modes = run(gate, STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[:-1] == [SPECULATE] * (STINT - 1) and modes[-1] == PLAIN  # measured; plain not yet: try it
    modes = run(gate, STINT + 20, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert set(modes) == {PLAIN}  # slower speculation stays off
    assert gate.rates == {(8, SPECULATE): pytest.approx(500.0), (8, PLAIN): pytest.approx(1000.0)}


def test_speculation_that_pays_is_kept_and_plain_is_probed_less_and_less_often() -> None:
    gate = SpeculationGate()
    modes = run(gate, 2000, {SPECULATE: 1500.0, PLAIN: 1000.0})
    assert modes[-1] == SPECULATE
    assert modes.count(PLAIN) < 0.05 * len(modes)
    first, later = modes[:200].count(PLAIN), modes[-1000:].count(PLAIN)
    assert later < first * 5  # the probes thin out (1000 steps hold fewer probes than the first 200's rate)


def test_a_probe_finds_a_drafter_that_got_better() -> None:
    gate = SpeculationGate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert gate.mode == PLAIN
    modes = run(gate, 4 * PROBE_EVERY, {SPECULATE: 2000.0, PLAIN: 1000.0})
    switched = modes.index(SPECULATE)
    assert switched <= PROBE_EVERY + WARMUP_STEPS  # at the next probe
    assert modes[switched:].count(SPECULATE) >= 0.8 * len(modes[switched:])  # kept, but for short probes


def test_another_batch_bucket_is_measured_on_its_own_and_k0_forces_plain() -> None:
    gate = SpeculationGate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    run(gate, STINT, {SPECULATE: 4000.0, PLAIN: 1000.0}, bucket=1)
    assert (1, PLAIN) in gate.rates and (1, SPECULATE) not in gate.rates  # the stint went on in plain
    gate.force(PLAIN)
    gate.observe(1, 1, 0.001)
    assert gate.mode == PLAIN


def test_a_speculating_stint_counts_from_its_first_verify_step() -> None:
    gate = SpeculationGate()
    gate.observe(8, 8, 0.001)  # plain-fast steps while the drafter has no drafts yet: not speculation's rate
    gate.observe(8, 8, 0.001)
    assert gate.stint.steps == 0 and gate.stint.waited == 2
    for _ in range(STINT):
        gate.observe(8, 8, 0.004, verified=True)
    assert gate.rates[(8, SPECULATE)] == pytest.approx(2000.0)
    stuck = SpeculationGate()
    for _ in range(UNPRIMED_STEPS + STINT):  # a drafter that never drafts still gets measured
        stuck.observe(8, 8, 0.01)
    assert stuck.rates[(8, SPECULATE)] == pytest.approx(800.0)


def test_a_probe_far_behind_ends_early() -> None:
    gate = SpeculationGate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    modes = run(gate, 3 * PROBE_EVERY, {SPECULATE: 500.0, PLAIN: 1000.0})
    probe = modes.index(SPECULATE)
    assert modes[probe:probe + WARMUP_STEPS + EARLY_STEPS] == [SPECULATE] * (WARMUP_STEPS + EARLY_STEPS)
    assert modes[probe + WARMUP_STEPS + EARLY_STEPS - 1] == SPECULATE and PLAIN in modes[probe:probe + STINT - 1]


def test_another_drafter_is_measured_again_before_either_mode_is_trusted() -> None:
    gate = SpeculationGate()
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
    gate = SpeculationGate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=1)
    assert gate.mode == PLAIN
    modes = run(gate, PROBE_EVERY, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    assert set(modes) == {PLAIN}  # not tried at once at batch 8
    modes = run(gate, 2 * PROBE_EVERY + 2 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0}, bucket=8)
    assert SPECULATE in modes and modes[-1] == PLAIN  # but probed when due, and lost
    assert (8, SPECULATE) in gate.rates
    winner = SpeculationGate()
    run(winner, 3 * STINT, {SPECULATE: 2000.0, PLAIN: 1000.0}, bucket=1)
    modes = run(winner, 2 * STINT, {SPECULATE: 2000.0, PLAIN: 1000.0}, bucket=8)
    assert modes[0] == SPECULATE  # it paid at batch 1: measured at once at batch 8


def test_steps_forced_plain_do_not_bring_the_next_probe_closer() -> None:
    gate = SpeculationGate()
    run(gate, 3 * STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert gate.mode == PLAIN
    for _ in range(3 * PROBE_EVERY):  # K = 0 for a long time
        gate.observe(8, 8, 0.008)
        gate.force(PLAIN)
    modes = run(gate, PROBE_EVERY - STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert set(modes) == {PLAIN}  # no probe as soon as K is back: the interval starts again


# ---- with the loss budget (--speculation-budget) ----


def test_plain_decoding_is_measured_first_then_speculating_and_the_faster_is_kept() -> None:
    gate = SpeculationGate(budgeted=True)
    modes = run(gate, STINT, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[:-1] == [PLAIN] * (STINT - 1) and modes[-1] == SPECULATE  # measured; speculating not yet: try it
    modes = run(gate, STINT + 20, {SPECULATE: 500.0, PLAIN: 1000.0})
    assert modes[0] == SPECULATE and set(modes[2:]) == {PLAIN}  # slower speculation stops, within its budget
    assert gate.rates == {(8, SPECULATE): pytest.approx(500.0), (8, PLAIN): pytest.approx(1000.0)}
    assert gate.switches == {"speculate/probe": 1, "plain/budget": 1}


def spend(gate: SpeculationGate, steps: int, speculating: Callable[[int], float], plain: float = 1000.0,
          bucket: int = 8) -> tuple[float, float, int]:
    """`steps` steps of `bucket` tokens: plain at `plain` tokens/s, the n-th step of a speculating
    stint at `speculating(n)`; (seconds taken, seconds plain decoding takes for those tokens,
    speculating steps)."""
    taken = tokens = n = speculated = 0
    for _ in range(steps):
        if gate.mode == SPECULATE:
            rate, n, speculated = speculating(n), n + 1, speculated + 1
        else:
            rate, n = plain, 0
        seconds = bucket / rate
        gate.observe(bucket, bucket, seconds, verified=gate.mode == SPECULATE and n > UNPRIMED_STEPS // 2)
        gate.decide()
        taken, tokens = taken + seconds, tokens + bucket
    return taken, tokens / plain, speculated


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0])
@pytest.mark.parametrize("slow_start", [0, 3])
def test_speculating_that_does_not_pay_costs_at_most_its_budget(ratio, slow_start) -> None:
    # Speculating at `ratio` of plain decoding's rate, each stint's first `slow_start` steps at a
    # third of it (a drafter taking the requests in): over any run the time lost against plain
    # decoding stays within MARGIN of it plus the cap and the one step that overdrew it.
    gate = SpeculationGate(budgeted=True)
    step = 8 / 1000.0
    worst = 8 / (1000.0 * min(ratio, 1 / 3 if slow_start else 1.0)) - step
    for steps in (50, 200, 2000):
        taken, plain_s, _ = spend(SpeculationGate(budgeted=True), steps,
                                  lambda n: 1000.0 * (ratio if n >= slow_start else 1 / 3))
        assert taken <= plain_s * (1 + MARGIN) + CAP_STEPS * step + worst + 1e-9, (steps, taken / plain_s)
    taken, plain_s, speculated = spend(gate, 5000, lambda n: 1000.0 * ratio)
    assert taken <= plain_s * (1 + MARGIN) + CAP_STEPS * step + worst + 1e-9  # 40 s: MARGIN in the long run
    assert speculated > 1  # it kept measuring (probes), spending what plain decoding saved


def test_a_stint_that_turns_bad_after_winning_long_ends_within_the_cap() -> None:
    gate = SpeculationGate(budgeted=True)
    spend(gate, 2000, lambda n: 2000.0)
    assert gate.mode == SPECULATE and gate.budgets[8].headroom_s == pytest.approx(CAP_STEPS * 8 / 1000.0)
    saved = gate.budgets[8].saved_s
    taken, plain_s, speculated = spend(gate, 100, lambda n: 250.0)  # the drafter got bad
    assert gate.mode == PLAIN and speculated <= 2
    assert taken - plain_s <= CAP_STEPS * 8 / 1000.0 + 8 / 250.0
    assert gate.budgets[8].saved_s < saved


def test_speculating_starts_again_only_with_headroom_saved() -> None:
    gate = SpeculationGate(budgeted=True)
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
    assert steps == pytest.approx((PROBE_FROM * budget.cap_s - owed) / earned, abs=1.5)


def test_speculating_starts_only_where_plain_is_measured_but_a_stint_the_batch_carries_goes_on() -> None:
    gate = SpeculationGate(budgeted=True)
    gate.force(SPECULATE)  # e.g. the gate was off: speculating at a bucket with no plain rate
    gate.observe(8, 8, 0.001, verified=True)
    assert gate.decide() == PLAIN and gate.switches["plain/unmeasured"] == 1
    gate = SpeculationGate(budgeted=True)
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
    gate = SpeculationGate(budgeted=True)
    spend(gate, 3 * STINT, lambda n: 3000.0, bucket=8)
    assert gate.mode == SPECULATE
    gate.observe(16, 16, 0.004, verified=True)  # new requests joined (or a new burst after an idle spell)
    assert gate.decide() == PLAIN and gate.switches["plain/unmeasured"] == 1
    gate = SpeculationGate()  # without the budget the rates alone decide: speculating goes on there
    spend(gate, 3 * STINT, lambda n: 3000.0, bucket=8)
    gate.observe(16, 16, 0.004, verified=True)
    assert gate.decide() == SPECULATE and "plain/unmeasured" not in gate.switches


def test_the_summary_says_what_the_gate_decided_and_why() -> None:
    gate = SpeculationGate(budgeted=True)
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
    gate = SpeculationGate(budgeted=True)
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
    gate = SpeculationGate(budgeted=True)
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
    # summary shows them, as after a stint of MEASURE_STEPS (before, the early end left them unset).
    gate = SpeculationGate()
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
