"""Figures from a benchmark's samples: percentiles, and metric totals scraped from a deployment's engines."""

from __future__ import annotations

import statistics

import httpx


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def scrape_metric_totals(deployment, prefix: str) -> dict[str, float]:
    """Each Prometheus metric whose name starts with `prefix`, summed over the deployment's engines
    and over its labels (histogram buckets and `_created` timestamps left out)."""
    totals: dict[str, float] = {}
    for url, _ in deployment.procs:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith(prefix) and "_bucket" not in line and "_created" not in line:
                name, value = line.rsplit(" ", 1)
                key = name.split("{", 1)[0]
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals
