"""The page hashes an engine's prefix cache holds, published as a log of stored and removed events.

The loop thread records each full page the cache gains or evicts; a reader (the API server, for the
routers that poll `/internal/kv_events`) asks for what happened since the sequence number it last saw.
A reader from another epoch (this engine restarted) or one that fell behind the bounded log gets a reset:
the whole set of hashes held now, then events from there. Hashes are `engine/page_hash.py`'s.

Wire form of an answer (JSON), documented in docs/routing.md:
    {"epoch": str, "seq": int, "page_size": int, "hash_version": int, "reset": bool,
     "events": [["stored" | "removed", "device", [hash, ...]], ...]}
With `reset`, `events` holds one "stored" entry: every hash held now.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from splitserve.engine.page_hash import VERSION

DEVICE = "device"


class PageEvents:
    """A bounded log of one engine's page events, and the set of hashes it holds now; thread-safe."""

    def __init__(self, page_size: int, max_log: int = 1 << 16) -> None:
        self.page_size = page_size
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._held: set[int] = set()
        # Events seq first_seq.. in order: (stored?, hash); trimmed to the newest max_log, in halves.
        self._log: list[tuple[bool, int]] = []
        self._first_seq = 1
        self._max_log = max_log
        self._seq = 0

    def _append(self, stored: bool, page_hash: int) -> None:
        self._seq += 1
        self._log.append((stored, page_hash))
        if len(self._log) > 2 * self._max_log:
            drop = len(self._log) - self._max_log
            del self._log[:drop]
            self._first_seq += drop

    def stored(self, page_hash: int) -> None:
        with self._lock:
            self._held.add(page_hash)
            self._append(True, page_hash)

    def removed(self, page_hash: int) -> None:
        with self._lock:
            self._held.discard(page_hash)
            self._append(False, page_hash)

    @property
    def held(self) -> int:
        return len(self._held)

    def since(self, epoch: str | None, seq: int) -> dict[str, Any]:
        """What a reader that saw `seq` of `epoch` has not seen yet (a reset if it cannot be told as events)."""
        with self._lock:
            head = {"epoch": self.epoch, "seq": self._seq, "page_size": self.page_size, "hash_version": VERSION}
            if epoch != self.epoch or seq > self._seq or seq < self._first_seq - 1:
                return {**head, "reset": True, "events": [["stored", DEVICE, sorted(self._held)]]}
            events: list[list[Any]] = []
            for stored, page_hash in self._log[seq + 1 - self._first_seq:]:
                op = "stored" if stored else "removed"
                if events and events[-1][0] == op:
                    events[-1][2].append(page_hash)
                else:
                    events.append([op, DEVICE, [page_hash]])
            return {**head, "reset": False, "events": events}
