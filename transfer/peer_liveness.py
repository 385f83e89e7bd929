"""Heartbeat bookkeeping: which peers are due a ping, which went silent, which restarted.

Pure logic on timestamps (the manager's control thread drives it). Any message from a peer
counts as a sign of life, not only a ``Pong``. A peer silent for ``interval_s * misses`` is
reported dead once and forgotten; when it is used again it is watched afresh (no blacklist).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PeerStatus:
    """What we know of one peer's control endpoint."""

    endpoint: str
    instance: str
    last_heard: float
    last_ping: float


class PeerLiveness:
    """Tracks the peers that have open rooms."""

    def __init__(self, interval_s: float, misses: int) -> None:
        self.interval_s = interval_s
        self.timeout_s = interval_s * misses
        self._peers: dict[str, PeerStatus] = {}

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def instance(self, endpoint: str) -> str:
        """The peer's last known instance id ("" when unknown)."""
        peer = self._peers.get(endpoint)
        return peer.instance if peer else ""

    def watch(self, endpoint: str, instance: str, now: float) -> None:
        """Starts watching ``endpoint`` (its silence is counted from ``now``)."""
        peer = self._peers.get(endpoint)
        if peer is None:
            self._peers[endpoint] = PeerStatus(endpoint, instance, now, now - self.interval_s)
        elif instance and not peer.instance:
            peer.instance = instance

    def unwatch(self, endpoint: str) -> None:
        self._peers.pop(endpoint, None)

    def heard(self, endpoint: str, instance: str, now: float) -> str | None:
        """Records a sign of life; returns the previous instance id if the peer restarted."""
        peer = self._peers.get(endpoint)
        if peer is None:
            return None
        peer.last_heard = now
        if instance and peer.instance and instance != peer.instance:
            old, peer.instance = peer.instance, instance
            return old
        if instance:
            peer.instance = instance
        return None

    def pings_due(self, now: float) -> list[str]:
        """Endpoints to ping now (each at most once per interval)."""
        due = []
        for peer in self._peers.values():
            if now - peer.last_ping >= self.interval_s:
                peer.last_ping = now
                due.append(peer.endpoint)
        return due

    def expire(self, now: float) -> list[str]:
        """Endpoints silent for longer than the heartbeat timeout; they are forgotten."""
        dead = [p.endpoint for p in self._peers.values() if now - p.last_heard > self.timeout_s]
        for endpoint in dead:
            del self._peers[endpoint]
        return dead
