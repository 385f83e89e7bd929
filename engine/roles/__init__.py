"""The disaggregated roles' behaviours, one module each, and the list each `--role` is made of
(roles compose: see engine/role.py)."""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.role import ComposedRole, Role
from splitserve.transfer import TransferConfig


def build_role(cfg: EngineConfig, transfer: TransferConfig) -> Role:
    """The role for `--role`: its behaviours in hook order; raises for roles this build cannot run."""
    return ComposedRole(cfg.role, role_behaviours(cfg, transfer))


def role_behaviours(cfg: EngineConfig, transfer: TransferConfig) -> list[Role]:
    """What `--role` adds to the loop, one behaviour per concern (the KV sender of prefill, ...)."""
    if cfg.role == "prefill":
        from splitserve.engine.roles.prefill import PrefillRole
        return [PrefillRole(transfer)]  # the KV sender
    if cfg.role == "decode":
        from splitserve.engine.roles.decode import DecodeRole
        return [DecodeRole(transfer)]  # the KV receiver
    raise ValueError(f"--role {cfg.role} is not implemented yet (unified, prefill and decode are)")
