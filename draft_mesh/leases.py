"""A drafter's leases: which verifier ranks joined, where their tails go, when they expire.

Written by the gRPC threads (Join, Heartbeat, Leave) and read by the engine loop, so every
method takes the lock. A rank is held by one verifier instance at a time: the same instance
joining again replaces its lease, another instance is refused while that lease lives (two live
verifiers with one rank would otherwise take the lease from each other in turn). The loop
collects ended leases (left, replaced by a rejoin, or silent past their ttl) with `take_ended`
and closes their requests.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    """One verifier rank's hold on this drafter."""

    lease_id: str
    verifier_rank: int
    verifier_instance: str
    tail_endpoint: str
    draft_tokens: int
    last_heartbeat: float


class RankHeld(RuntimeError):
    """Another live verifier instance holds this rank's lease."""


class LeaseTable:
    """Leases by id, at most one per verifier rank."""

    def __init__(self, ttl_s: float, max_leases: int) -> None:
        self.ttl_s = ttl_s
        self.max_leases = max_leases
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._ended: list[Lease] = []

    def grant(self, verifier_rank: int, verifier_instance: str, tail_endpoint: str, draft_tokens: int,
              now: float | None = None) -> Lease | None:
        """A new lease (replacing this instance's old one); None when the table is full; raises
        RankHeld when another instance holds the rank."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            for old in [lease for lease in self._leases.values() if lease.verifier_rank == verifier_rank]:
                if old.verifier_instance != verifier_instance:
                    raise RankHeld(f"verifier rank {verifier_rank} is held by the live verifier "
                                   f"{old.verifier_instance}; give each verifier its own --verifier-rank")
                self._end(old)
            if len(self._leases) >= self.max_leases:
                return None
            lease = Lease(secrets.token_hex(8), verifier_rank, verifier_instance, tail_endpoint, draft_tokens, now)
            self._leases[lease.lease_id] = lease
            return lease

    def heartbeat(self, lease_id: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._expire(now)
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            lease.last_heartbeat = now
            return True

    def leave(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._end(lease)
            return lease is not None

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def take_ended(self, now: float | None = None) -> list[Lease]:
        """Leases that ended since the last call (expired ones included)."""
        with self._lock:
            self._expire(time.monotonic() if now is None else now)
            ended, self._ended = self._ended, []
            return ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _expire(self, now: float) -> None:
        for lease in [lease for lease in self._leases.values() if now - lease.last_heartbeat > self.ttl_s]:
            self._end(lease)

    def _end(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        self._ended.append(lease)
