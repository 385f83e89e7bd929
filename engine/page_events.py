"""The page hashes an engine holds, per tier, published as a log of stored and removed events.

Tiers: "device" (the prefix cache's pages), "host" (the host KV tier's) and "store" (pages of the shared store tier
this engine wrote or read there and has not seen go: the store evicts on its own, so this is what the engine knows,
not all the store holds). Each full page a tier gains or evicts is recorded; a reader (the API server, for the
routers that poll `/internal/kv_events`) asks for what happened since the sequence number it last saw.
A reader from another epoch (this engine restarted) or one that fell behind the bounded log gets a reset:
the whole set of hashes held now, then events from there. Hashes are `engine/page_hash.py`'s.

Wire form of an answer (JSON), documented in docs/routing.md:
    {"epoch": str, "seq": int, "page_size": int, "hash_version": int, "reset": bool, "store": str | null,
     "events": [["stored" | "removed", "device" | "host" | "store", [hash, ...]], ...]}
With `reset`, `events` holds one "stored" entry per tier: every hash it holds now. `store` names the shared store
(its address and key namespace; null without one): engines that name the same store reach each other's "store" pages.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from splitserve.engine.page_hash import VERSION

DEVICE = "device"
HOST = "host"
STORE = "store"
TIERS = (DEVICE, HOST, STORE)


class PageEvents:
    """A bounded log of one engine's page events, and the hashes each tier holds now; thread-safe."""

    def __init__(self, page_size: int, max_log: int = 1 << 16) -> None:
        self.page_size = page_size
        self.epoch = secrets.token_hex(8)
        self.store: str | None = None  # the shared store's name, set by the store tier
        self._lock = threading.Lock()
        self._held: dict[str, set[int]] = {tier: set() for tier in TIERS}
        # Events seq first_seq.. in order: (stored?, tier, hash); trimmed to the newest max_log, in halves.
        self._log: list[tuple[bool, str, int]] = []
        self._first_seq = 1
        self._max_log = max_log
        self._seq = 0

    def _append(self, stored: bool, tier: str, page_hash: int) -> None:
        self._seq += 1
        self._log.append((stored, tier, page_hash))
        if len(self._log) > 2 * self._max_log:
            drop = len(self._log) - self._max_log
            del self._log[:drop]
            self._first_seq += drop

    def stored(self, page_hash: int, tier: str = DEVICE) -> None:
        with self._lock:
            self._held[tier].add(page_hash)
            self._append(True, tier, page_hash)

    def removed(self, page_hash: int, tier: str = DEVICE) -> None:
        with self._lock:
            self._held[tier].discard(page_hash)
            self._append(False, tier, page_hash)

    @property
    def held(self) -> int:
        """Pages the device tier holds."""
        return len(self._held[DEVICE])

    def held_in(self, tier: str) -> int:
        return len(self._held[tier])

    def since(self, epoch: str | None, seq: int) -> dict[str, Any]:
        """What a reader that saw `seq` of `epoch` has not seen yet (a reset if it cannot be told as events)."""
        with self._lock:
            head = {"epoch": self.epoch, "seq": self._seq, "page_size": self.page_size, "hash_version": VERSION,
                    "store": self.store}
            if epoch != self.epoch or seq > self._seq or seq < self._first_seq - 1:
                everything = [["stored", tier, sorted(held)] for tier, held in self._held.items() if held]
                return {**head, "reset": True, "events": everything}
            events: list[list[Any]] = []
            for stored, tier, page_hash in self._log[seq + 1 - self._first_seq:]:
                op = "stored" if stored else "removed"
                if events and events[-1][0] == op and events[-1][1] == tier:
                    events[-1][2].append(page_hash)
                else:
                    events.append([op, tier, [page_hash]])
            return {**head, "reset": False, "events": events}
