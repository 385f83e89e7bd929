"""Prometheus metrics of the transfer layer, per transfer.

Collectors are created once per registry (default: prometheus_client's global one) and
shared by every manager that uses it, so several managers in one process never trip
"Duplicated timeseries" errors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class TransferMetrics:
    """The collectors; labels: ``side`` (sender|receiver), ``outcome`` (success|failed)."""

    bytes_total: Counter
    rooms_total: Counter
    latency_seconds: Histogram
    wait_seconds: Histogram
    fenced_rooms: Gauge
    fences_total: Counter
    _children: dict[tuple[str, bool], tuple[Any, Any, Any, Any]] = field(default_factory=dict, repr=False)

    def room_done(self, side: str, success: bool, nbytes: int, latency_s: float | None,
                  wait_s: float | None) -> None:
        """Records one finished room."""
        rooms, nbytes_total, latency, wait = self._labelled(side, success)
        rooms.inc()
        if nbytes:
            nbytes_total.inc(nbytes)
        if success and latency_s is not None:
            latency.observe(latency_s)
        if wait_s is not None:
            wait.observe(wait_s)

    def rooms_done(self, side: str, rooms: list[tuple[bool, int, float | None]]) -> None:
        """Records several finished rooms, ``(success, bytes, latency)`` each (no waits): ``room_done`` for each,
        with one update of the counters per outcome (a merged write's rooms finish together)."""
        for success in (True, False):
            done = [r for r in rooms if r[0] is success]
            if not done:
                continue
            count, nbytes_total, latency, _ = self._labelled(side, success)
            count.inc(len(done))
            nbytes = sum(r[1] for r in done)
            if nbytes:
                nbytes_total.inc(nbytes)
            if success:
                for r in done:
                    if r[2] is not None:
                        latency.observe(r[2])

    def room_waited(self, side: str, wait_s: float) -> None:
        """Records a room's wait for its peer when it ends (``room_done``'s ``wait_s``, observed earlier: the
        sender's at its metadata's arrival, on the control thread, not on the worker that finishes it)."""
        self._labelled(side, True)[3].observe(wait_s)

    def _labelled(self, side: str, success: bool) -> tuple[Any, Any, Any, Any]:
        """The labelled children, looked up once per (side, outcome): a lookup costs more than the update."""
        children = self._children.get((side, success))
        if children is None:
            children = self._children[(side, success)] = (
                self.rooms_total.labels(side, "success" if success else "failed"), self.bytes_total.labels(side),
                self.latency_seconds.labels(side), self.wait_seconds.labels(side))
        return children


_BY_REGISTRY: dict[int, tuple[CollectorRegistry, TransferMetrics]] = {}
_LOCK = threading.Lock()


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The transfer metrics registered in ``registry`` (created on first use)."""
    registry = REGISTRY if registry is None else registry
    with _LOCK:
        entry = _BY_REGISTRY.get(id(registry))
        if entry is not None and entry[0] is registry:
            return entry[1]
        metrics = TransferMetrics(
            bytes_total=Counter("splitserve_transfer_bytes", "KV and aux bytes written or received",
                                ["side"], registry=registry),
            rooms_total=Counter("splitserve_transfer_rooms", "Transfers finished, by outcome",
                                ["side", "outcome"], registry=registry),
            latency_seconds=Histogram(
                "splitserve_transfer_latency_seconds",
                "Sender: first chunk queued to success; receiver: metadata sent to success",
                ["side"], buckets=_LATENCY_BUCKETS, registry=registry),
            wait_seconds=Histogram(
                "splitserve_transfer_wait_seconds",
                "Sender: creation to the decode's metadata in hand (decode page allocation wait); "
                "receiver: creation to metadata sent",
                ["side"], buckets=_LATENCY_BUCKETS, registry=registry),
            fenced_rooms=Gauge("splitserve_transfer_fenced_rooms",
                               "Failed rooms whose decode pages are held until no write for them can land",
                               registry=registry),
            fences_total=Counter("splitserve_transfer_fences",
                                 "Fences lifted, by how: acknowledged, peer gone, deadline",
                                 ["outcome"], registry=registry),
        )
        _BY_REGISTRY[id(registry)] = (registry, metrics)
        return metrics
