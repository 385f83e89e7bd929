"""A drafter that joins just before a load, and is slow to take its first requests in, still gets its
drafts verified with the verifier's default speculation flags (gate and budget on): the gate's first
probe finds no drafts, which is no evidence, and speculating is tried again shortly after. CPU, the
tiny model as target and (exact) drafter, real gRPC and ZeroMQ on loopback, both engines in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from servers import free_port

from splitserve.draft_mesh import SpecConfig
from splitserve.draft_mesh.speculation_gate import UNPRIMED_STEPS
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.role import ComposedRole
from splitserve.engine.roles.drafter import DrafterRole, drafter_engine_config
from splitserve.engine.roles.verifier import VerifierRole
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer import TransferConfig

KEY = "c5" * 16
TRANSFER = TransferConfig(transfer_control_key=KEY)
ENGINE = {"device": "cpu", "page_size": 4, "max_total_tokens": 2048, "max_running_requests": 8}
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43, 44, 45], [100, 7, 100]]
# Fewer steps than a lost probe's interval (PROBE_EVERY, doubled): before the fix the first probe, which
# found no drafts, counted as a loss and no other probe came in the run.
PARAMS = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
WAIT_MS = 40.0
FIRST_INTAKE_S = 0.1  # the drafter's loop is busy this long when the first requests reach it


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in reversed(started):
        engine.stop()


def test_a_drafter_that_joins_just_before_the_load_gets_its_drafts_verified_with_default_flags(
        engines, monkeypatch) -> None:
    plain_engine = Engine(EngineConfig(model="tiny", **ENGINE))
    plain_engine.start()
    try:
        reference = generate_tokens(plain_engine, PROMPTS, PARAMS)
    finally:
        plain_engine.stop()

    # A cold drafter: its loop thread is busy for FIRST_INTAKE_S when the first control messages come (as a
    # drafter process compiling or planning for its first shapes would be); what comes meanwhile waits.
    first = threading.Event()
    apply = DrafterRole.apply

    def slow_first_apply(self: DrafterRole, batch) -> None:
        if not first.is_set():
            first.set()
            time.sleep(FIRST_INTAKE_S)
        apply(self, batch)

    monkeypatch.setattr(DrafterRole, "apply", slow_first_apply)
    spec = SpecConfig(draft_mesh_port=free_port())
    drafter = Engine(drafter_engine_config(EngineConfig(model="tiny", **ENGINE)),
                     role=ComposedRole("drafter", [DrafterRole(spec, TRANSFER)]))
    drafter.start()
    engines.append(drafter)
    endpoint = f"127.0.0.1:{drafter.role.health_info()['draft_mesh_port']}"
    # Every speculation flag at its default (gate and budget on); a draft wait as in the engine's speculative
    # tests: the tiny drafter is no faster than the tiny target on a CPU, so it needs time to get ahead at all.
    verifier_spec = SpecConfig(drafter=[endpoint], draft_wait_ms=WAIT_MS)
    assert verifier_spec.speculation_gate and verifier_spec.speculation_budget
    role = VerifierRole(verifier_spec, TRANSFER)
    verifier = Engine(EngineConfig(model="tiny", **ENGINE), role=ComposedRole("unified", [role]))
    verifier.start()
    engines.append(verifier)
    deadline = time.monotonic() + 10
    while not role.drafters:  # joined: the load starts right away
        assert time.monotonic() < deadline, role.health_info()
        verifier.call_soon(lambda: None)
        time.sleep(0.02)

    started = time.monotonic()
    assert generate_tokens(verifier, PROMPTS, PARAMS) == reference
    elapsed = time.monotonic() - started
    metrics = verifier.metrics
    accepted = metrics.spec_accepted_tokens._value.get()
    switches = dict(role.gate.switches)
    assert first.is_set() and elapsed > FIRST_INTAKE_S, elapsed  # the drafter's slow start fell inside the run
    assert "plain/probe lost" not in switches, switches  # the probes without drafts were not taken as losses ...
    assert accepted > 0 and role.verify_steps > 0, (accepted, switches, role.gate.summary())  # ... and drafts came
    assert switches.get("plain/no drafts", 0) >= 1 or role.gate.stint.waited >= UNPRIMED_STEPS, switches
