"""Where each streamed request's time to first token went, attributed at the router.

The router stamps a request when it receives it, when it sends it to the engines (after validating, templating,
tokenizing and routing it, and after any failed attempts) and when the first token comes back. The engines
stamp the points between (engine/phase_timing.py): the decode (or unified replica) in its first-token marker,
the prefill in its answer to the handoff. Laid end to end, the stamps split the router's TTFT into phases:

  1P1D:    router | intake | decode_admission | prefill_queue | prefill_compute | transfer | kv_notice
           | first_step | first_token | relay
           (--no-prefill-waits-for-decode: router | intake | prefill_queue | prefill_compute | decode_admission
           | transfer | ...)
  unified: router | intake | prefill_queue | prefill_compute | first_token | relay

  router            received -> sent to the engines
  intake            -> the engine loop took it in (network, the engine's API server, its inbox)
  prefill_queue     -> its first prompt step was scheduled
  prefill_compute   -> its first token was sampled (1P1D: and the last KV pages and aux data handed to the sender)
  decode_admission  -> the prefill has the decode's metadata (the decode reserved the pages the KV goes to); where
                       the prompt computes meanwhile, it comes after prefill_compute: the time the KV waited for it
  transfer          -> the prefill's last write into the decode's memory returned (the copies, and whatever device
                       work they queued behind)
  kv_notice         -> the decode has every page and the aux data (the room's Success message, and the decode loop
                       reading it between its steps); a prefill that sends no `written` stamp leaves `transfer` out,
                       and this phase then covers both
  first_step        -> the decode emitted the first token
  first_token       -> the router has it (the engine's API server, its stream, the network)
  relay             -> the router hands it to the client's connection

Stamps from other hosts are as good as their clocks' agreement (NTP); a boundary earlier than the one before
it is moved up to it, so no phase is negative and the phases still add up to the router's TTFT. Each phase
goes into `splitserve_phase_seconds{phase}`, the whole into `splitserve_router_time_to_first_token_seconds`,
and, with tracing, into spans (api/otel.py). A client that sends `x-splitserve-phases: 1` gets its request's
phases as an SSE comment before `data: [DONE]`: ``: phases {"phases": {...}, "marks": [[name, time], ...]}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.api.otel import Tracing
from splitserve.engine.metrics import PHASE_BUCKETS
from splitserve.engine.phase_timing import (
    ARRIVED,
    BOOTSTRAPPED,
    FIRST_TOKEN,
    SCHEDULED,
    SHIPPED,
    TAKEN,
    WRITTEN,
    waited_for_decode,
)

logger = logging.getLogger(__name__)

PHASES_HEADER = "x-splitserve-phases"
PHASES_COMMENT = b": phases "
PREFILL_ANSWER_WAIT_S = 1.0  # a stream that ended well waits this long, at most, for its prefill's answer

# Each phase by the stamp that ends it: (phase, whose stamp, which).
DISAGGREGATED = (("router", "router", "sent"), ("intake", "prefill", TAKEN),
                 ("decode_admission", "prefill", BOOTSTRAPPED), ("prefill_queue", "prefill", SCHEDULED),
                 ("prefill_compute", "prefill", SHIPPED), ("transfer", "prefill", WRITTEN),
                 ("kv_notice", "engine", ARRIVED), ("first_step", "engine", FIRST_TOKEN),
                 ("first_token", "router", "first_token"), ("relay", "router", "relayed"))
# A prefill that computed while the decode reserved pages (its bootstrapped stamp after scheduled).
COMPUTED_AHEAD = (*DISAGGREGATED[:2], *DISAGGREGATED[3:5], DISAGGREGATED[2], *DISAGGREGATED[5:])
OPTIONAL = frozenset({"transfer"})  # phases whose stamp an older engine does not send: left out, the next covers it
UNIFIED = (("router", "router", "sent"), ("intake", "engine", TAKEN), ("prefill_queue", "engine", SCHEDULED),
           ("prefill_compute", "engine", FIRST_TOKEN), ("first_token", "router", "first_token"),
           ("relay", "router", "relayed"))


@dataclass(eq=False)
class RequestTiming:
    """One request's stamps at the router, and the engines' (one per sequence of a fanned-out request)."""

    received: float
    report: bool = False  # the client asked for its phases (PHASES_HEADER)
    sent: float | None = None  # its last attempt went to the engines
    first_token: float | None = None  # the first token is at the router
    relayed: float | None = None  # ... and sent on to the client
    engine: dict[str, float] | None = None  # the decode's (unified replica's) stamps, from its first-token marker
    prefill: dict[str, float] | None = None  # the prefill's, from its answer
    span: Any = None  # the root span, with tracing
    headers: dict[str, str] = field(default_factory=dict)  # for the engines: the root span's traceparent
    done: bool = False

    def stamps(self, disaggregated: bool) -> list[tuple[str, float]] | None:
        """(phase, the stamp that ends it), in order, after the received stamp; None while one is missing."""
        own = {"sent": self.sent, "first_token": self.first_token, "relayed": self.relayed}
        sources = {"router": own, "engine": self.engine or {}, "prefill": self.prefill or {}}
        out = []
        order = UNIFIED
        if disaggregated:
            order = DISAGGREGATED if waited_for_decode(self.prefill or {}) else COMPUTED_AHEAD
        for phase, whose, name in order:
            value = sources[whose].get(name)
            if value is None and phase in OPTIONAL:
                continue
            if value is None:
                return None
            out.append((phase, float(value)))
        return out


def attribute(received: float, stamps: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) laid end to end from `received`; a stamp earlier than the one before it (another
    host's clock) is moved up to it."""
    phases, start = [], received
    for phase, end in stamps:
        end = max(end, start)
        phases.append((phase, start, end))
        start = end
    return phases


class PhaseRecorder:
    """The router's phase metrics (and spans), fed one request at a time."""

    def __init__(self, registry: CollectorRegistry, disaggregated: bool, tracing: Tracing | None = None) -> None:
        self.disaggregated = disaggregated
        self.tracing = tracing
        self.seconds = Histogram("splitserve_phase_seconds", "Streamed requests' time to first token at the router, "
                                 "by phase (router/phases.py)", ["phase"], buckets=PHASE_BUCKETS, registry=registry)
        self.ttft = Histogram("splitserve_router_time_to_first_token_seconds", "Streamed requests' time from the "
                              "router's receipt to their first token relayed", buckets=PHASE_BUCKETS,
                              registry=registry)
        self.unattributed = Counter("splitserve_phase_unattributed", "Streamed requests whose phases could not be "
                                    "told (an engine's stamps missing)", registry=registry)

    def start(self, received: float, headers: Any, report: bool, name: str = "router.request") -> RequestTiming:
        timing = RequestTiming(received, report=report)
        if self.tracing is not None:
            timing.span = self.tracing.start(name, received, headers)
            timing.headers = self.tracing.headers(timing.span)
        elif headers is not None and headers.get("traceparent"):  # passed on untouched
            timing.headers = {"traceparent": headers["traceparent"]}
        return timing

    async def settle(self, timing: RequestTiming, prefill_task: asyncio.Task | None) -> list | None:
        """Records a stream that has ended well (waiting a little for its prefill's answer, which carries the
        prefill's stamps); returns its phases, or None when they cannot be told. Once per request."""
        if timing.done:
            return None
        if prefill_task is not None and not prefill_task.done() and timing.prefill is None:
            await asyncio.wait({prefill_task}, timeout=PREFILL_ANSWER_WAIT_S)
        return self.record(timing)

    def record(self, timing: RequestTiming) -> list[tuple[str, float, float]] | None:
        if timing.done:
            return None
        timing.done = True
        stamps = timing.stamps(self.disaggregated)
        if stamps is None or timing.relayed is None:
            self.unattributed.inc()
            self._end_span(timing, None)
            return None
        phases = attribute(timing.received, stamps)
        for phase, start, end in phases:
            self.seconds.labels(phase).observe(end - start)
        self.ttft.observe(max(0.0, timing.relayed - timing.received))
        if self.tracing is not None and timing.span is not None:
            self.tracing.children(timing.span, phases)
        self._end_span(timing, None)
        return phases

    def close(self, timing: RequestTiming | None, error: str | None = None) -> None:
        """The request is over: its root span ends (with `error`, if it failed) unless it was recorded."""
        if timing is not None and not timing.done:
            timing.done = True
            self._end_span(timing, error)

    def _end_span(self, timing: RequestTiming, error: str | None) -> None:
        if self.tracing is not None and timing.span is not None:
            self.tracing.end(timing.span, time.time(), error)
            timing.span = None


def phases_comment(timing: RequestTiming, phases: list[tuple[str, float, float]] | None,
                   disaggregated: bool) -> bytes:
    """The SSE comment a client that asked for its phases gets before `data: [DONE]`: each phase's seconds,
    and the raw stamps in order (received first), as the router got them."""
    stamps = timing.stamps(disaggregated) or []
    body = {"phases": {p: end - start for p, start, end in phases} if phases else None,
            "marks": [["received", timing.received], *[[p, t] for p, t in stamps]]}
    return PHASES_COMMENT + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
