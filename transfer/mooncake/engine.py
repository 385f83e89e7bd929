"""The one place that calls Mooncake's ``TransferEngine``.

Mooncake calls return an int status and never raise; each is checked here and turned into
``MooncakeCallError``. Mooncake calls may block (up to 60 s on a peer that accepts but never
answers, 30 s on a frozen one), so only the manager's worker threads call ``write``; the
engine's scheduler never does.

Mooncake's ports (RPC handshake and TCP data) listen on all interfaces with no
authentication unless ``MC_TCP_BIND_ADDRESS`` narrows the data port: anyone who can reach
them can write into registered memory. Run it on a private network (Kubernetes network
policy) only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

from splitserve.transfer.errors import MooncakeCallError, RdmaUnavailableError, TransferEngineUnavailableError

log = logging.getLogger(__name__)



def _retire(engine: object) -> None:
    """Never destroys ``engine``: the OS reclaims it at exit.

    Destroying a Mooncake TransferEngine holds the GIL for about a second (it joins its own
    threads), freezing every Python thread of the process (heartbeats stop, peers declare us
    dead), and at interpreter exit it costs a second per engine. A closed engine has no
    registered memory left, so keeping it is harmless; its reference count is raised so that
    neither the garbage collector nor interpreter shutdown runs its destructor.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine))

RDMA_SYSFS = Path("/sys/class/infiniband")


def rdma_devices() -> list[str]:
    """Names of the RDMA devices of this machine (empty without any)."""
    try:
        return sorted(p.name for p in RDMA_SYSFS.iterdir())
    except OSError:
        return []


class MooncakeEngine:
    """A Mooncake ``TransferEngine`` with peer-to-peer handshake (no metadata server)."""

    def __init__(self, host: str, protocol: str, devices: str = "") -> None:
        if protocol == "rdma":
            found = rdma_devices()
            wanted = [d for d in devices.split(",") if d]
            if not found or any(d not in found for d in wanted):
                raise RdmaUnavailableError(devices, found)
        elif protocol != "tcp":
            raise ValueError(f"unknown transfer protocol {protocol!r} (rdma or tcp)")
        if host in ("127.0.0.1", "localhost"):
            # Keep the TCP data port on loopback when we only advertise loopback.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferEngineUnavailableError(
                f"cannot import mooncake ({exc}); install the transfer-cpu extra "
                "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1"
            ) from exc
        self.host = host
        self.protocol = protocol
        self.devices = devices
        engine = TransferEngine()
        code = engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
        if code != 0:
            _retire(engine)
            raise MooncakeCallError("initialize", code, f"host {host}, protocol {protocol}")
        self._engine: Any = engine
        self.session_id = f"{host}:{engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()

    def register(self, ptr: int, length: int) -> None:
        """Registers ``[ptr, ptr + length)`` so peers may write into it."""
        code = self._engine.register_memory(ptr, length) if self._engine is not None else -1
        if code != 0:
            raise MooncakeCallError("register_memory", code, f"ptr {ptr:#x}, {length} bytes")
        with self._lock:
            self._registered.append(ptr)

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """Synchronous batch write to the peer ``session``; returns Mooncake's status (0 = ok)."""
        engine = self._engine
        if engine is None:
            return -1
        return int(engine.batch_transfer_sync_write(session, srcs, dsts, lens))

    def close(self) -> None:
        """Unregisters every region; the engine itself is never destroyed (see ``_retire``)."""
        with self._lock:
            ptrs, self._registered = self._registered, []
            engine, self._engine = self._engine, None
        if engine is None:
            return
        for ptr in ptrs:
            code = engine.unregister_memory(ptr)
            if code != 0:
                log.warning("mooncake unregister_memory(%#x) returned %d", ptr, code)
        _retire(engine)
