"""Heartbeat bookkeeping: pings per interval, silence means dead, a new instance means restarted."""

from __future__ import annotations

from splitserve.transfer.peer_liveness import PeerLiveness


def test_silent_peer_expires_after_interval_times_misses_and_is_forgotten():
    live = PeerLiveness(interval_s=1.0, misses=3)
    live.watch("a", "i1", now=0.0)
    assert live.pings_due(0.0) == ["a"] and live.pings_due(0.5) == [] and live.pings_due(1.0) == ["a"]
    live.heard("a", "i1", now=2.0)
    assert live.expire(4.9) == []
    assert live.expire(5.1) == ["a"]
    assert "a" not in live and live.expire(10.0) == []
    live.watch("a", "", now=11.0)  # used again: watched afresh, no blacklist
    assert live.expire(12.0) == []


def test_new_instance_reports_a_restart():
    live = PeerLiveness(interval_s=1.0, misses=3)
    live.watch("a", "", now=0.0)
    assert live.heard("a", "i1", now=0.1) is None
    assert live.heard("a", "i2", now=0.2) == "i1"
    assert live.instance("a") == "i2"
