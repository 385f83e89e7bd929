"""Where one request's time to first token goes inside an engine: timestamps at the moments that split it.

The engine loop stamps a request (`mark`) as it passes each point; the stamps travel with the request's
first output (`take`) to the API server, which hands them on (the first-token marker of a stream, the
prefill's answer to a handoff) so the router can attribute a request's whole TTFT (router/phases.py).
Stamps are wall-clock seconds (`time.time()`): they are compared with other processes' stamps, on this
host or on others whose clocks NTP keeps together.

The marks, in the order a request passes them:
  taken         the loop took the request in from its inbox
  admitted      decode: its pages are reserved and its metadata went to the prefill
  bootstrapped  prefill: the decode's metadata arrived (the request may now compute; with
                --no-prefill-waits-for-decode no earlier than shipped: the time it held the KV back)
  scheduled     the first step with a chunk of its prompt was launched
  first_token   its first token is known (sampled; on a decode: read from the prefill's aux data)
  shipped       prefill: the last KV pages and the aux data were handed to the sender
  written       prefill: the last write into the decode's memory returned (its side of the room at Success)
  arrived       decode: every KV page and the aux data landed (it read the room's Success)

Each engine also observes its own phases (`engine_phases`) in `splitserve_phase_seconds`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.metrics import EngineMetrics
    from splitserve.engine.request import Request

TAKEN, ADMITTED, BOOTSTRAPPED, SCHEDULED = "taken", "admitted", "bootstrapped", "scheduled"
FIRST_TOKEN, SHIPPED, WRITTEN, ARRIVED = "first_token", "shipped", "written", "arrived"


def mark(req: Request, name: str, at: float | None = None) -> None:
    """Stamps `req` at mark `name` (now, or `at`) the first time it gets there (until its stamps were taken)."""
    marks = req.phase_marks
    if marks is not None and name not in marks:
        marks[name] = time.time() if at is None else at


def take(req: Request, metrics: EngineMetrics | None) -> dict[str, float] | None:
    """The request's stamps, once (None after): they go out with its first output. With `metrics`, the
    engine's own phases are observed (pass None for a request that failed or was aborted)."""
    marks = req.phase_marks
    if marks is None:
        return None
    req.phase_marks = None
    if metrics is not None:
        for phase, start, end in engine_phases(marks):
            metrics.phase(phase, end - start)
    return marks


def waited_for_decode(marks: dict[str, float]) -> bool:
    """A prefill's stamps say it computed only once the decode's metadata was there (bootstrapped no later than
    scheduled); one that computed meanwhile stamps bootstrapped at shipped or later."""
    return marks.get(BOOTSTRAPPED, float("inf")) <= marks.get(SCHEDULED, float("-inf"))


def engine_phases(marks: dict[str, float]) -> list[tuple[str, float, float]]:
    """The phases one engine sees of a request, as (phase, start, end), from its stamps (those it has):
      decode_admission  prefill: shipped -> bootstrapped (the KV waiting for the decode to reserve pages; where
                        the prompt waited for that instead, taken -> bootstrapped, before prefill_queue);
                        decode: taken -> admitted (reserving them)
      prefill_queue     taken (prefill that waited for the decode: bootstrapped) -> scheduled
      prefill_compute   scheduled -> first_token (prefill: -> shipped)
      transfer          prefill: shipped (or bootstrapped, when later) -> written (the copies, queued behind the
                        device's work)
      kv_wait           decode: admitted -> arrived (the prefill's queue, compute and the transfer)
      first_step        decode: arrived -> first_token
    """
    m = marks
    spans: list[tuple[str, str, str]] = []
    if ARRIVED in m:  # a decode
        spans = [("decode_admission", TAKEN, ADMITTED), ("kv_wait", ADMITTED, ARRIVED),
                 ("first_step", ARRIVED, FIRST_TOKEN)]
    elif (BOOTSTRAPPED in m or SHIPPED in m) and waited_for_decode(m):
        spans = [("decode_admission", TAKEN, BOOTSTRAPPED), ("prefill_queue", BOOTSTRAPPED, SCHEDULED),
                 ("prefill_compute", SCHEDULED, SHIPPED),  # a prefill that waited for the decode's metadata
                 ("transfer", SHIPPED, WRITTEN)]
    elif BOOTSTRAPPED in m or SHIPPED in m:  # a prefill that computed meanwhile
        spans = [("prefill_queue", TAKEN, SCHEDULED), ("prefill_compute", SCHEDULED, SHIPPED),
                 ("decode_admission", SHIPPED, BOOTSTRAPPED), ("transfer", BOOTSTRAPPED, WRITTEN)]
    else:  # unified
        spans = [("prefill_queue", TAKEN, SCHEDULED), ("prefill_compute", SCHEDULED, FIRST_TOKEN)]
    return [(phase, m[start], max(m[start], m[end])) for phase, start, end in spans if start in m and end in m]
