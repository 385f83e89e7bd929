"""The speculation gate: a step verifies drafts only while timed verify steps beat plain decoding."""

from __future__ import annotations

from splitserve.draft_mesh.speculation_gate import PROBE_EVERY, REFRESH_EVERY, SpeculationGate


def test_plain_decoding_is_timed_first_then_verifying_is_tried() -> None:
    gate = SpeculationGate()
    assert not gate.verify_pays(8, 5, expected_tokens=30)  # nothing to compare with yet
    gate.observe(8, 1, 0.010)
    assert gate.verify_pays(8, 5, expected_tokens=30)  # verify steps of this kind not timed yet: try one


def test_verifying_pays_when_its_tokens_come_faster_and_not_otherwise() -> None:
    gate = SpeculationGate()
    gate.observe(8, 1, 0.010)  # plain: 800 tokens/s
    gate.observe(8, 5, 0.020)
    assert gate.verify_pays(8, 5, expected_tokens=24)  # 1,200 tokens/s
    assert not gate.verify_pays(8, 5, expected_tokens=12)  # 600 tokens/s
    assert gate.likely_off(8, 5, expected_tokens=12) and not gate.likely_off(8, 5, expected_tokens=24)
    assert not gate.verify_pays(1, 5, expected_tokens=4)  # another batch: its plain time first


def test_an_off_gate_probes_and_an_on_gate_refreshes_the_plain_time() -> None:
    gate = SpeculationGate()
    gate.observe(8, 1, 0.010)
    gate.observe(8, 5, 0.020)
    for _ in range(PROBE_EVERY - 2):
        gate.observe(8, 1, 0.010)
        assert not gate.verify_pays(8, 5, expected_tokens=12)
    assert not gate.likely_off(8, 5, expected_tokens=12)  # a probe is near: drafters draft again
    gate.observe(8, 1, 0.010)
    assert gate.verify_pays(8, 5, expected_tokens=12)  # the probe
    gate.observe(8, 5, 0.005)  # the drafter got cheaper: verifying pays now
    for _ in range(REFRESH_EVERY - 2):
        assert gate.verify_pays(8, 5, expected_tokens=24)
        gate.observe(8, 5, 0.005)
    assert not gate.verify_pays(8, 5, expected_tokens=24)  # one plain step keeps the plain time current
