"""The planner's inputs and outputs in the operator, as pure functions: Prometheus text -> an ``Observation``,
a ``Decision`` -> scale patches and the group's ``status.planner``.

Each interval the planner loop (``operator/planner_loop.py``) scrapes ``/metrics`` of the group's router and engine
pods; these functions turn two consecutive scrapes into what ``SLOPlanner.decide`` reads:

- **Percentiles from histogram buckets**: the per-pod bucket counts' increase over the interval (a pod that
  restarted counts from zero, as Prometheus' ``increase`` does), summed over the role's pods, then
  ``histogram_quantile``'s linear interpolation inside the bucket the rank falls in.
- **Rates from counter deltas**: the increase of a counter over the interval's seconds.
- **Gauges** (waiting and running requests, KV pages) as scraped at the end of the interval.

TTFT comes from the decode engines (their clock starts when the router hands them the request, at the same time as
the prefill's, and stops when the first token lands on them: the client's TTFT less the router's hop), or from the
prefill engines when decode saw no first token; ITL from the decode engines. The arrival rate is the router's
requests (every outcome); the mean prompt length is the prefill engines' admitted prompt tokens per finished
request, the mean output length the decode engines' generated tokens per finished request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from splitserve.planner.policy import (
    DECODE,
    PREFILL,
    ROLES,
    SLO,
    Decision,
    Observation,
    PlannerConfig,
    RoleLimits,
)

TTFT = "splitserve_time_to_first_token_seconds"
ITL = "splitserve_inter_token_latency_seconds"
WAITING = "splitserve_requests_waiting"
RUNNING = "splitserve_requests_running"
KV_USED = "splitserve_kv_pages_used"
KV_FREE = "splitserve_kv_pages_free"
PROMPT_TOKENS = "splitserve_prompt_tokens_total"
GENERATION_TOKENS = "splitserve_generation_tokens_total"
FINISHED = "splitserve_requests_finished_total"
ROUTER_REQUESTS = "splitserve_router_requests_total"
ROUTER_ROLE = "router"

Labels = tuple[tuple[str, str], ...]
# (sample name, sorted labels) -> value
Samples = dict[tuple[str, Labels], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by its full name (``_bucket``, ``_total``...) and
    labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return samples


def sample_sum(samples: Samples, name: str, **match: str) -> float:
    """The sum of every sample named ``name`` whose labels include ``match``."""
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == want for k, want in match.items()))


def counter_increase(current: float, previous: float | None) -> float:
    """A counter's increase between two scrapes; a value that went down means a restart (count from zero)."""
    if previous is None or current < previous:
        return current
    return current - previous


def histogram_buckets(samples: Samples, name: str) -> dict[float, float]:
    """Upper bound -> cumulative count of the histogram ``name``, summed over its other labels."""
    buckets: dict[float, float] = {}
    for (n, labels), value in samples.items():
        if n != f"{name}_bucket":
            continue
        le = dict(labels).get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "Inf") else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets


def bucket_increase(current: Mapping[float, float], previous: Mapping[float, float] | None) -> dict[float, float]:
    """Per-bucket increase of one pod's histogram between two scrapes (all of it when the pod restarted)."""
    if previous is None or any(current.get(b, 0.0) < v for b, v in previous.items()):
        return dict(current)
    return {b: v - previous.get(b, 0.0) for b, v in current.items()}


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: ``q`` (0..1) of cumulative ``buckets`` (upper bound -> count), linear
    within the bucket the rank falls in; None without observations. A rank in the +Inf bucket gives the largest
    finite bound (all that is known: at least that)."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]] if math.isinf(bounds[-1]) else max(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1]


@dataclass(frozen=True)
class PodScrape:
    """One pod's ``/metrics`` at one time; ``samples`` is None when the scrape failed."""

    role: str
    pod: str
    samples: Samples | None


@dataclass
class Interval:
    """What one interval's scrapes add up to, before the planner reads it (also shown in the status)."""

    seconds: float
    ttft_s: float | None = None
    itl_s: float | None = None
    arrival_rate: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    waiting: dict[str, int] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    running_decodes: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    prefill_queue_tokens: int = 0
    scraped: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (scraped, found)


def _pairs(current: Sequence[PodScrape], previous: Mapping[str, Samples], role: str
           ) -> list[tuple[Samples, Samples | None]]:
    return [(s.samples, previous.get(s.pod)) for s in current if s.role == role and s.samples is not None]


def _increase(pairs: Iterable[tuple[Samples, Samples | None]], name: str) -> float:
    return sum(counter_increase(sample_sum(cur, name), None if prev is None else sample_sum(prev, name))
               for cur, prev in pairs)


def _histogram_increase(pairs: Iterable[tuple[Samples, Samples | None]], name: str) -> dict[float, float]:
    merged: dict[float, float] = {}
    for cur, prev in pairs:
        for bound, count in bucket_increase(histogram_buckets(cur, name),
                                            None if prev is None else histogram_buckets(prev, name)).items():
            merged[bound] = merged.get(bound, 0.0) + count
    return merged


def summarize(current: Sequence[PodScrape], previous: Mapping[str, Samples], seconds: float,
              percentile: float) -> Interval:
    """One interval from this interval's scrapes and the last one's (pod name -> samples; a pod missing there is
    new: its counters count from zero). ``percentile``: 0..1."""
    out = Interval(seconds=max(seconds, 1e-6))
    prefill, decode, router = (_pairs(current, previous, r) for r in (PREFILL, DECODE, ROUTER_ROLE))
    for role in (PREFILL, DECODE, ROUTER_ROLE):
        found = [s for s in current if s.role == role]
        out.scraped[role] = (sum(s.samples is not None for s in found), len(found))
    ttft = _histogram_increase(decode, TTFT)
    if not ttft or max(ttft.values()) <= 0:
        ttft = _histogram_increase(prefill, TTFT)
    out.ttft_s = histogram_quantile(percentile, ttft)
    out.itl_s = histogram_quantile(percentile, _histogram_increase(decode, ITL))

    decode_finished = _increase(decode, FINISHED)
    prefill_finished = _increase(prefill, FINISHED)
    arrivals = _increase(router, ROUTER_REQUESTS) if router else max(decode_finished, prefill_finished)
    out.arrival_rate = arrivals / out.seconds
    if prefill_finished > 0:
        out.prompt_tokens = _increase(prefill, PROMPT_TOKENS) / prefill_finished
    if decode_finished > 0:
        out.output_tokens = _increase(decode, GENERATION_TOKENS) / decode_finished
    for role, pairs in ((PREFILL, prefill), (DECODE, decode)):
        out.waiting[role] = int(sum(sample_sum(cur, WAITING) for cur, _ in pairs))
        out.running[role] = int(sum(sample_sum(cur, RUNNING) for cur, _ in pairs))
    out.running_decodes = [int(sample_sum(cur, RUNNING)) for cur, _ in decode]
    for cur, _ in decode:
        used, free = sample_sum(cur, KV_USED), sample_sum(cur, KV_FREE)
        if used + free > 0:
            out.kv_usage.append(used / (used + free))
    # Engines gauge requests, not tokens: the prompt tokens queued at prefill are its waiting requests at the
    # interval's mean prompt length.
    out.prefill_queue_tokens = int(out.waiting[PREFILL] * out.prompt_tokens)
    return out


def observation(interval: Interval, time_s: float, replicas: Mapping[str, int], ready: Mapping[str, int],
                fallback_lengths: tuple[float, float] = (0.0, 0.0)) -> Observation:
    """The planner's ``Observation`` of an interval. ``replicas``: each role's spec.replicas (serving or on
    their way); ``ready``: those serving. ``fallback_lengths``: mean (prompt, output) tokens to assume when the
    interval finished no request (the last ones seen)."""
    prompt = interval.prompt_tokens or fallback_lengths[0]
    output = interval.output_tokens or fallback_lengths[1]
    return Observation(
        time_s=time_s, ttft_s=interval.ttft_s, itl_s=interval.itl_s,
        prefill_queue_tokens=interval.prefill_queue_tokens, running_decodes=list(interval.running_decodes),
        kv_usage=list(interval.kv_usage), arrival_rate=interval.arrival_rate, prompt_tokens=prompt,
        output_tokens=output, replicas={r: int(replicas.get(r, 0)) for r in ROLES},
        ready={r: min(int(ready.get(r, 0)), int(replicas.get(r, 0))) for r in ROLES})


def planner_config(slo: Mapping[str, Any]) -> PlannerConfig:
    """The planner's configuration from a group's ``spec.slo`` (schema defaults filled in where absent)."""
    limits = {}
    for role in ROLES:
        bounds = (slo.get("roles") or {}).get(role) or {}
        low = int(bounds.get("minReplicas", 1))
        limits[role] = RoleLimits(min=low, max=max(low, int(bounds.get("maxReplicas", 8))))
    return PlannerConfig(
        slo=SLO(ttft_s=float(slo["ttftSeconds"]), itl_s=float(slo["itlSeconds"]),
                percentile=float(slo.get("percentile", 90)) / 100.0),
        limits=limits,
        interval_s=float(slo.get("intervalSeconds", 15)),
        startup_s=float(slo.get("startupSeconds", 120)),
        scale_down_intervals=int(slo.get("scaleDownIntervals", 4)),
        allow_switch=bool(slo.get("roleSwitch", True)),
    )


def scale_patches(decision: Decision, current: Mapping[str, int]) -> dict[str, int]:
    """Role -> replicas to write through its ServingRole's scale subresource: only the roles that change."""
    return {role: int(n) for role, n in decision.replicas.items()
            if role in ROLES and int(n) != int(current.get(role, 0))}


def scale_body(replicas: int) -> dict[str, Any]:
    """The merge patch of a scale subresource setting ``replicas``."""
    return {"spec": {"replicas": int(replicas)}}


def pd(replicas: Mapping[str, int]) -> str:
    """``prefill:decode``."""
    return f"{int(replicas.get(PREFILL, 0))}:{int(replicas.get(DECODE, 0))}"


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def decision_text(decision: Decision) -> str:
    """The decision's changes in one line, e.g. ``prefill 1 -> 2: scale up: ...``."""
    return "; ".join(f"{c.role} {c.before} -> {c.after}: {c.reason}" for c in decision.changes)


def planner_status(interval: Interval, obs: Observation, decision: Decision, now: str,
                   previous: Mapping[str, Any] | None, message: str = "") -> dict[str, Any]:
    """``status.planner`` after one run: what it observed, current and desired P:D, the last decision and why."""
    previous = previous or {}
    observed: dict[str, Any] = {
        "ttftSeconds": _rounded(interval.ttft_s), "itlSeconds": _rounded(interval.itl_s, 5),
        "arrivalRate": _rounded(interval.arrival_rate), "promptTokens": _rounded(obs.prompt_tokens, 1),
        "outputTokens": _rounded(obs.output_tokens, 1), "prefillQueueTokens": int(obs.prefill_queue_tokens),
        "waiting": {r: int(interval.waiting.get(r, 0)) for r in ROLES},
        "running": {r: int(interval.running.get(r, 0)) for r in ROLES},
        "kvUsage": _rounded(sum(obs.kv_usage) / len(obs.kv_usage)) if obs.kv_usage else None,
        "scraped": ", ".join(f"{r} {n}/{m}" for r, (n, m) in interval.scraped.items()),
    }
    status: dict[str, Any] = {
        "lastRunTime": now,
        # None deletes the key in a merge patch: a metric with no samples this interval is shown as absent.
        "observed": observed,
        "current": pd(obs.replicas),
        "desired": pd(decision.replicas),
        "replicas": {r: {"current": int(obs.replicas[r]), "desired": int(decision.replicas[r])} for r in ROLES},
        "message": message or (decision_text(decision) if decision.changes else
                               f"no change: {pd(obs.replicas)} meets the targets at "
                               f"{interval.arrival_rate:.2f} req/s"),
    }
    if decision.changes:
        status["lastDecision"] = decision_text(decision)
        status["lastDecisionTime"] = now
    else:
        for key in ("lastDecision", "lastDecisionTime"):
            if previous.get(key):
                status[key] = previous[key]
    return status
