"""The speculation gate: the engine speculates only while that measurably emits tokens faster."""

from __future__ import annotations

import pytest

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
