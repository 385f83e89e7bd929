"""The one place that calls Mooncake's ``TransferEngine``.

Mooncake calls return an int status and never raise; each is checked here and turned into
``MooncakeCallError``. Mooncake calls may block (up to 60 s on a peer that accepts but never
answers, 30 s on a frozen one), so only the manager's worker threads call ``write``; the
engine's scheduler never does.

Mooncake's ports (RPC handshake and TCP data) listen with no authentication: anyone who can
reach them can write into registered memory. Mooncake itself binds them to every interface
whatever host it is given (``MC_TCP_BIND_ADDRESS`` only picks the address it advertises); with
a loopback transfer host (one machine: ``splitserve up``) they are narrowed to loopback by
``loopback_bind``. Elsewhere run it on a private network (the operator's NetworkPolicy) only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitserve.transfer.errors import MooncakeCallError, RdmaUnavailableError, TransferEngineUnavailableError
from splitserve.transfer.mooncake.loopback_bind import bind_mooncake_to_loopback, loopback_for

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

# glog's severities. Mooncake logs through glog to stderr, and starting an engine prints lines a healthy
# start should not: `E transfer_metadata.cpp] Local segment descriptor not found` (the P2P handshake mode
# looks its own segment up before it has added it), `W topology.cpp] No RDMA devices found` (it discovers
# the topology for TCP too) and a dozen I lines. Mooncake returns a status for every failure, which this
# module checks and raises (and our callers log): its own log is detail, quiet unless asked for.
GLOG_WARNING, GLOG_FATAL = 1, 3
# Where the caller picks Mooncake's log level itself (MC_LOG_LEVEL=INFO to see all of it), it is left alone.
LOG_LEVEL_ENV = ("MC_LOG_LEVEL", "GLOG_minloglevel")
_glog_lock = threading.Lock()


@functools.cache
def _glog_minloglevel() -> ctypes.c_int32 | None:
    """glog's FLAGS_minloglevel in the libglog Mooncake loaded (None where it cannot be found: glog
    linked into Mooncake statically, or no /proc)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libglog" in line and "/" in line})
        for path in paths:
            with contextlib.suppress(OSError, ValueError):
                return ctypes.c_int32.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE")
    except OSError:
        pass
    return None


@contextlib.contextmanager
def quiet_mooncake_start() -> Iterator[bool]:
    """While an engine is created and initialized only FATAL lines reach stderr; afterwards WARNING and
    above do (a failed write's reason still shows). Yields whether it quieted anything: not where the
    caller set MC_LOG_LEVEL or GLOG_minloglevel."""
    if any(name in os.environ for name in LOG_LEVEL_ENV):
        yield False
        return
    level = _glog_minloglevel()
    if level is None:
        yield False
        return
    with _glog_lock:
        level.value = GLOG_FATAL
        try:
            yield True
        finally:
            level.value = GLOG_WARNING


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
        loopback = loopback_for(host) is not None
        if loopback:
            # The address Mooncake advertises when it has to pick one itself.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferEngineUnavailableError(
                f"cannot import mooncake ({exc}); install the transfer-cpu extra "
                "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1"
            ) from exc
        if loopback:
            # We only advertise loopback: Mooncake's listening ports go there too, not on every interface.
            bind_mooncake_to_loopback(host)
        self.host = host
        self.protocol = protocol
        self.devices = devices
        with quiet_mooncake_start() as quiet:
            engine = TransferEngine()
            code = engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
        if code != 0:
            _retire(engine)
            hint = "; MC_LOG_LEVEL=INFO shows Mooncake's own log of it" if quiet else ""
            raise MooncakeCallError("initialize", code, f"host {host}, protocol {protocol}{hint}")
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
