"""Request traces for the simulator: seeded generators and a JSON-lines reader.

A trace is a list of ``TraceRequest`` (arrival second, prompt tokens, output tokens), sorted by arrival.
A JSON-lines trace file holds one ``{"arrival_s": 0.42, "prompt_tokens": 8000, "output_tokens": 1000}`` a line.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def poisson_arrivals(rate: Callable[[float], float], peak: float, duration_s: float,
                     rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of time-varying ``rate`` (at most ``peak``), by thinning."""
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        if rng.random() * peak < rate(t):
            times.append(t)


def sinusoidal_trace(duration_s: float = 900.0, low: float = 1.0, high: float = 8.0, period_s: float = 900.0,
                     prompt_tokens: int = 8000, output_tokens: int = 1000, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals whose rate goes ``low -> high -> low`` as a cosine of ``period_s``, fixed lengths."""
    mid, amp = (high + low) / 2, (high - low) / 2

    def rate(t: float) -> float:
        return mid - amp * math.cos(2 * math.pi * t / period_s)

    rng = random.Random(seed)
    return [TraceRequest(t, prompt_tokens, output_tokens) for t in poisson_arrivals(rate, high, duration_s, rng)]


def dynamo_10528(seed: int = 0) -> list[TraceRequest]:
    """The shape of a reported failure of Dynamo's SLA planner: 8,000-token prompts, 1,000 tokens out, arrival rate
    1 -> 8 -> 1 req/s as a sinusoid over 900 s (Poisson arrivals). Served from 1P1D at TTFT 3 s, ITL 30 ms."""
    return sinusoidal_trace(900.0, 1.0, 8.0, 900.0, 8000, 1000, seed)


def oscillating_trace(duration_s: float = 1800.0, phase_s: float = 60.0, seed: int = 0) -> list[TraceRequest]:
    """Load that swings every ``phase_s`` between a prompt-heavy phase (long prompts, few tokens out) and a
    decode-heavy one (short prompts, long outputs), with quiet gaps: made to drive many scale-downs and switches."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    phases = [(4.0, 6000, 20), (6.0, 300, 600), (0.3, 500, 100)]  # rate, prompt, output
    start, i = 0.0, 0
    while start < duration_s:
        rate, prompt, output = phases[i % len(phases)]
        length = min(phase_s, duration_s - start)
        for t in poisson_arrivals(lambda _t, r=rate: r, rate, length, rng):
            p = max(16, int(rng.gauss(prompt, prompt / 8)))
            o = max(1, int(rng.gauss(output, output / 8)))
            out.append(TraceRequest(start + t, p, o))
        start += phase_s
        i += 1
    return out


TRACES: dict[str, Callable[[], list[TraceRequest]]] = {
    "dynamo-10528": dynamo_10528,
    "oscillating": oscillating_trace,
}


def load_trace(name_or_path: str) -> list[TraceRequest]:
    """A named trace (``TRACES``) or a JSON-lines file."""
    if name_or_path in TRACES:
        return TRACES[name_or_path]()
    rows = [json.loads(line) for line in Path(name_or_path).read_text().splitlines() if line.strip()]
    trace = [TraceRequest(float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"])) for r in rows]
    return sorted(trace, key=lambda r: r.arrival_s)
