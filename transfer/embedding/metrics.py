"""Prometheus metrics of the embedding transfer and the encoder: created once per registry."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class EmbeddingMetrics:
    """Labels: ``side`` (encoder|prefill), ``outcome`` (success|failed)."""

    items_total: Counter
    bytes_total: Counter
    transfer_seconds: Histogram
    encode_seconds: Histogram
    cache_hits_total: Counter
    cache_misses_total: Counter
    slots_fenced: Gauge
    fences_total: Counter
    items_refused: Counter

    def item_done(self, side: str, success: bool, nbytes: int, seconds: float | None) -> None:
        self.items_total.labels(side=side, outcome="success" if success else "failed").inc()
        if success:
            self.bytes_total.labels(side=side).inc(nbytes)
            if seconds is not None:
                self.transfer_seconds.labels(side=side).observe(seconds)


_BY_REGISTRY: dict[int, tuple[CollectorRegistry, EmbeddingMetrics]] = {}
_LOCK = threading.Lock()


def embedding_metrics(registry: CollectorRegistry | None = None) -> EmbeddingMetrics:
    registry = REGISTRY if registry is None else registry
    with _LOCK:
        entry = _BY_REGISTRY.get(id(registry))
        if entry is not None and entry[0] is registry:
            return entry[1]
        metrics = EmbeddingMetrics(
            items_total=Counter("splitserve_embedding_items", "Image items transferred, by outcome",
                                ["side", "outcome"], registry=registry),
            bytes_total=Counter("splitserve_embedding_bytes", "Embedding bytes written or received",
                                ["side"], registry=registry),
            transfer_seconds=Histogram("splitserve_embedding_transfer_seconds",
                                       "Encoder: rows ready to written; prefill: staged to landed",
                                       ["side"], buckets=_BUCKETS, registry=registry),
            encode_seconds=Histogram("splitserve_embedding_encode_seconds", "Vision tower + projector time per batch",
                                     buckets=_BUCKETS, registry=registry),
            cache_hits_total=Counter("splitserve_embedding_cache_hits", "Images served from the encoder's cache",
                                     registry=registry),
            cache_misses_total=Counter("splitserve_embedding_cache_misses", "Images the encoder computed",
                                       registry=registry),
            slots_fenced=Gauge("splitserve_embedding_slots_fenced",
                               "Prefill: slots of failed items held until no write of their encoder can land",
                               registry=registry),
            fences_total=Counter("splitserve_embedding_fences",
                                 "Prefill: slot fences lifted, by how: acknowledged, peer gone, deadline",
                                 ["outcome"], registry=registry),
            items_refused=Counter("splitserve_embedding_items_refused",
                                  "Prefill: items failed before taking a slot: past the fenced-slot bound, "
                                  "their encoder holds fenced slots", registry=registry),
        )
        _BY_REGISTRY[id(registry)] = (registry, metrics)
        return metrics
