"""The disaggregated roles: what each adds to the engine loop, one module each."""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.role import Role
from splitserve.transfer import TransferConfig


def build_role(cfg: EngineConfig, transfer: TransferConfig) -> Role:
    """The role object for `--role`; raises for roles this build cannot run."""
    if cfg.role == "prefill":
        from splitserve.engine.roles.prefill import PrefillRole
        return PrefillRole(transfer)
    if cfg.role == "decode":
        from splitserve.engine.roles.decode import DecodeRole
        return DecodeRole(transfer)
    raise ValueError(f"--role {cfg.role} is not implemented yet (unified, prefill and decode are)")
