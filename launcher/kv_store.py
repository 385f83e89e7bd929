"""`splitserve kv-store`: a Mooncake Store master, the shared KV tier's metadata service (docs/kv_tiers.md).

The operator runs it as a group's or a namespace's KV store (spec.kvStore); it replaces itself with Mooncake's
`mooncake_master` binary (from the installed mooncake package), so the pod's process is the master itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.config_flags import parse_config

logger = logging.getLogger(__name__)


@dataclass
class KVStoreMasterConfig:
    """Where the master listens."""

    host: str = field(default="0.0.0.0", metadata={"help": "address of its RPC and admin ports"})
    port: int = field(default=50051, metadata={"help": "RPC port: engines' --kv-store HOST:PORT"})
    admin_port: int = field(default=9003, metadata={"help": "admin port: /health and /metrics"})

    def __post_init__(self) -> None:
        for name in ("port", "admin_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be within 1..65535, got {getattr(self, name)}")
        if self.port == self.admin_port:
            raise ValueError(f"--port and --admin-port are both {self.port}")


def master_argv(cfg: KVStoreMasterConfig) -> list[str]:
    """The `mooncake_master` command line for `cfg`."""
    from splitserve.engine.store_kv import master_command

    return master_command(cfg.port, cfg.host, cfg.admin_port)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(KVStoreMasterConfig, argv, prefix="SPLITSERVE_KV_STORE", prog="splitserve kv-store",
                       description="a Mooncake Store master for the shared KV tier")
    command = master_argv(cfg)
    logger.info("exec %s", " ".join(command))
    os.execv(command[0], command)
    return 1  # unreachable: execv does not return
