"""The disaggregated roles' behaviours, one module each, and the list each `--role` is made of
(roles compose: see engine/role.py)."""

from __future__ import annotations

import dataclasses

from splitserve.draft_mesh import SpecConfig
from splitserve.draft_mesh.config import drafters_from_peers
from splitserve.engine.config import EngineConfig
from splitserve.engine.role import ComposedRole, Role
from splitserve.transfer import TransferConfig


def build_role(cfg: EngineConfig, transfer: TransferConfig, spec: SpecConfig | None = None) -> Role:
    """The role for `--role`: its behaviours in hook order; raises for roles this build cannot run."""
    return ComposedRole(cfg.role, role_behaviours(cfg, transfer, spec or SpecConfig()))


def role_behaviours(cfg: EngineConfig, transfer: TransferConfig, spec: SpecConfig) -> list[Role]:
    """What `--role` adds to the loop, one behaviour per concern (the KV sender of prefill, ...)."""
    if cfg.role == "prefill":
        from splitserve.engine.roles.prefill import PrefillRole
        return [PrefillRole(transfer)]  # the KV sender
    if cfg.role == "decode":
        from splitserve.engine.roles.decode import DecodeRole
        return [DecodeRole(transfer), *verifier(transfer, spec)]  # the KV receiver (+ the verifier)
    if cfg.role == "unified":
        return verifier(transfer, spec) or [Role()]
    if cfg.role == "drafter":
        from splitserve.engine.roles.drafter import DrafterRole
        return [DrafterRole(spec, transfer)]  # the draft model + the draft mesh server
    raise ValueError(f"--role {cfg.role} is not implemented yet (unified, prefill, decode and drafter are)")


def verifier(transfer: TransferConfig, spec: SpecConfig) -> list[Role]:
    """The verifier behaviour when there are drafters to join (--drafter, or the peers file's), else nothing."""
    drafters = spec.drafter or (drafters_from_peers(spec.peers_file) if spec.peers_file else [])
    if not drafters:
        return []
    from splitserve.engine.roles.verifier import VerifierRole
    return [VerifierRole(dataclasses.replace(spec, drafter=drafters), transfer)]
