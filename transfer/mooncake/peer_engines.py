"""Mooncake engines to write through, one per peer: a peer that freezes in its first handshake
stalls only its own writes.

Mooncake 0.3.13's Python binding opens a session (the first handshake with a peer: an RPC whose
socket read times out after a fixed 60 s, ``MC_HANDSHAKE_CONNECT_TIMEOUT`` bounds only its
connect) while holding a mutex of its ``TransferEngine``, and every write of that engine takes the
same mutex. Each engine has its own, and a region may be registered with several engines, so the
sender writes to each peer session through an engine of its own: up to ``max_engines`` of them,
created on a peer's first write (a few ms, no network), each registering the manager's buffers.
Past the cap, a new peer shares the engine with the fewest peers (the stall is then shared by
those). Engines are never destroyed (see ``mooncake_engine._retire``), so they are reused, not
replaced: a peer keeps its engine, and its session stays open there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from splitserve.transfer.kv.plan import PageRuns
from splitserve.transfer.mooncake.engine import MooncakeEngine

log = logging.getLogger(__name__)


class PeerEngines:
    """Routes each write to its peer session's own engine; ``fallback`` (the manager's engine)
    takes every write when ``max_engines`` is 0 or an engine cannot be created."""

    def __init__(self, fallback: MooncakeEngine, regions: list[tuple[int, int]], max_engines: int) -> None:
        self.fallback = fallback
        self.regions = regions
        self.max_engines = max_engines
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()  # creation is local (ms) but must not run twice for a session
        self._engines: list[MooncakeEngine] = []
        self._peers: dict[int, int] = {}  # id(engine) -> peer sessions routed to it
        self._by_session: dict[str, MooncakeEngine] = {}
        self._closed = False

    @property
    def engines(self) -> int:
        """Writer engines created so far (the fallback not counted)."""
        with self._lock:
            return len(self._engines)

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """Mooncake's synchronous batch write to ``session`` through its own engine (0 = ok)."""
        return self._engine_for(session).write(session, srcs, dsts, lens)

    def launch_pages(self, session: str, runs: PageRuns) -> Callable[[], int]:
        """Whole pages as runs (``PageRuns``), for a transport that takes them (CUDA IPC's ``launch_pages``):
        returns once the copy is queued, with the call that waits for it."""
        return self._engine_for(session).launch_pages(session, runs)  # type: ignore[attr-defined]

    def _engine_for(self, session: str) -> MooncakeEngine:
        with self._lock:
            engine = self._by_session.get(session)
            if engine is not None or self.max_engines == 0 or self._closed:
                return engine or self.fallback
        with self._create_lock:
            with self._lock:
                engine = self._by_session.get(session)
                if engine is not None:
                    return engine
                full = len(self._engines) >= self.max_engines
            created = None if full else self._create()
            with self._lock:
                if self._closed:
                    return self.fallback
                if created is not None:
                    self._engines.append(created)
                    self._peers[id(created)] = 0
                if not self._engines:
                    return self.fallback
                engine = created or min(self._engines, key=lambda e: self._peers[id(e)])
                self._peers[id(engine)] += 1
                self._by_session[session] = engine
                return engine

    def _create(self) -> MooncakeEngine | None:
        try:
            engine = MooncakeEngine(self.fallback.host, self.fallback.protocol, self.fallback.devices)
        except Exception:
            log.exception("cannot create a writer engine; writing through the shared one")
            return None
        try:
            for ptr, nbytes in self.regions:
                engine.register(ptr, nbytes)
        except Exception:
            log.exception("cannot register memory with a writer engine; writing through the shared one")
            engine.close()
            return None
        return engine

    def close(self) -> None:
        """Unregisters every writer engine's memory (the engines themselves are parked)."""
        with self._create_lock, self._lock:
            self._closed = True
            engines, self._engines = self._engines, []
            self._by_session.clear()
        for engine in engines:
            engine.close()
