"""A discrete-event simulation of one serving group (prefill and decode pools behind a router), with a planner in
the loop, fast enough for CI: an event heap, and decode batches stepped arithmetically (no per-token events).

The group, as ``docs/architecture.md`` describes it:

- The **router** keeps arrivals in a FIFO. It dispatches the head request once some accepting decode engine can
  reserve KV for its prompt and output (and has a batch slot), to that decode (the most free KV) and to the
  accepting prefill engine with the fewest queued prompt tokens: decode pressure backs up into the router's queue.
- A **prefill** engine serves its queue FIFO, one prompt at a time (or, with ``prefill_token_budget``, as many
  queued prompts as fit the budget in one forward); the KV then takes ``transfer_s`` to land on the decode engine,
  which is when the first token reaches the client (TTFT).
- A **decode** engine runs continuous batching: a request joins at the next step boundary, each step takes
  ``DecodeModel.step_seconds`` of the batch and its context (which grows by one token a step), and a request
  leaves after ``output_tokens - 1`` steps (its first token came from prefill). ITL is a request's mean gap.
- The **planner** is called every ``interval_s`` with an ``Observation`` of the last interval. A new pod serves
  ``startup_s`` after it is asked for; a **role switch** drains the engine's in-flight work, then takes
  ``switch_s``; a **scale-down** drains (no new work, finish every request it holds), then the pod goes. Pods still
  starting are cancelled first. No request is ever dropped or re-run.
- **GPU-hours** count every pod from when it was asked for until it goes: starting, serving, draining, switching.

Run ``python3 -P -m splitserve.planner.simulator --trace dynamo-10528 --png out.png`` for the planner against the
best static prefill:decode split on a trace.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.planner.policy import (
    DECODE,
    PREFILL,
    ROLES,
    SLO,
    Decision,
    Observation,
    PlannerConfig,
    RoleLimits,
    SLOPlanner,
)
from splitserve.planner.service_model import DecodeModel, ServiceModel, default_model
from splitserve.planner.traces import TraceRequest, load_trace

logger = logging.getLogger(__name__)


class Policy(Protocol):
    """Anything with SLOPlanner's ``decide``."""

    def decide(self, obs: Observation) -> Decision: ...


@dataclass(frozen=True)
class GroupConfig:
    """The simulated group: starting replicas and the timings of its changes."""

    prefill: int = 1
    decode: int = 1
    startup_s: float = 120.0
    switch_s: float = 5.0
    transfer_s: float = 0.05
    interval_s: float = 15.0
    prefill_token_budget: int = 0  # 0: one prompt a forward


class SimRequest:
    """One request's path through the group."""

    __slots__ = ("arrival", "decode", "decoded", "finish", "first_token", "join_ctx", "join_step", "output",
                 "prefill", "prefill_end", "prefills", "prompt", "rid")

    def __init__(self, rid: int, r: TraceRequest) -> None:
        self.rid = rid
        self.arrival = r.arrival_s
        self.prompt = r.prompt_tokens
        self.output = r.output_tokens
        self.decode: DecodeEngine | None = None
        self.prefill: PrefillEngine | None = None
        self.prefill_end: float | None = None
        self.first_token: float | None = None
        self.finish: float | None = None
        self.prefills = 0
        self.decoded = 0
        self.join_step = 0
        self.join_ctx = 0

    @property
    def ttft(self) -> float:
        """Seconds from arrival to the first token (inf if none yet)."""
        return math.inf if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> float:
        """Mean seconds between output tokens after the first (inf if unfinished)."""
        if self.finish is None or self.first_token is None:
            return math.inf
        return 0.0 if self.output <= 1 else (self.finish - self.first_token) / (self.output - 1)

    def meets(self, slo: SLO) -> bool:
        """Both SLOs met."""
        return self.ttft <= slo.ttft_s and self.itl <= slo.itl_s


class Gpu:
    """One pod's GPU, from the ask to the pod going (a role switch keeps the GPU)."""

    __slots__ = ("start", "stop")

    def __init__(self, start: float) -> None:
        self.start = start
        self.stop: float | None = None


class Engine:
    """State shared by both roles: ``starting`` (pod or switch on its way), ``ready``, ``draining``, ``stopped``."""

    role = ""

    def __init__(self, eid: int, gpu: Gpu, state: str) -> None:
        self.eid = eid
        self.gpu = gpu
        self.state = state
        self.switch_to: Engine | None = None  # the engine this one becomes once drained
        self.switch_from: Engine | None = None  # the engine draining into this one (state "starting")
        self.cancelled = False

    def work(self) -> float:
        """How much in-flight work this engine holds (drain order: least first)."""
        raise NotImplementedError

    def idle(self) -> bool:
        """Nothing in flight."""
        raise NotImplementedError


class PrefillEngine(Engine):
    """FIFO prompt queue, one forward at a time."""

    role = PREFILL

    def __init__(self, eid: int, gpu: Gpu, state: str) -> None:
        super().__init__(eid, gpu, state)
        self.queue: deque[SimRequest] = deque()
        self.queued_tokens = 0
        self.busy_tokens = 0
        self.busy = False

    def work(self) -> float:
        return self.queued_tokens + self.busy_tokens

    def idle(self) -> bool:
        return not self.busy and not self.queue


class DecodeEngine(Engine):
    """Continuous batching, stepped arithmetically between events."""

    role = DECODE

    def __init__(self, eid: int, gpu: Gpu, state: str, model: DecodeModel) -> None:
        super().__init__(eid, gpu, state)
        self.m = model
        self.reserved_tokens = 0
        self.reserved_count = 0
        self.k = 0  # steps done
        self.tk = 0.0  # time of step k's end
        self.b = 0  # sequences in the batch
        self.ctx_sum = 0  # their context tokens at step k
        self.finishing: list[tuple[int, int, SimRequest]] = []  # (finish step, rid, request)
        self.pending: list[SimRequest] = []  # KV landed mid-step: join at the next boundary
        self.pending_step = 0
        self.version = 0

    def work(self) -> float:
        return self.reserved_count

    def idle(self) -> bool:
        return self.reserved_count == 0

    def fits(self, r: SimRequest) -> bool:
        """Can reserve KV and a batch slot for ``r``."""
        return (self.reserved_tokens + r.prompt + r.output <= self.m.kv_capacity_tokens
                and self.reserved_count < self.m.max_batch)

    def _base(self) -> float:
        return self.m.fixed + self.m.per_seq * self.b + self.m.per_token * self.ctx_sum

    def duration(self, steps: int) -> float:
        """Seconds of the next ``steps`` steps from step k (the context grows a token per sequence a step)."""
        return steps * self._base() + self.m.per_token * self.b * steps * (steps - 1) / 2

    def steps_by(self, t: float) -> int:
        """Steps completed between step k and time ``t``."""
        elapsed = t - self.tk
        if elapsed <= 0 or self.b == 0:
            return 0
        a = self.m.per_token * self.b / 2
        lin = self._base() - a
        m = int(elapsed / lin) if a <= 0 else int((-lin + math.sqrt(lin * lin + 4 * a * elapsed)) / (2 * a))
        while self.duration(m + 1) <= elapsed:
            m += 1
        while m > 0 and self.duration(m) > elapsed:
            m -= 1
        return m


@dataclass
class IntervalRecord:
    """One planner interval: load, replicas (asked for and serving), latencies at the SLO percentile."""

    time_s: float
    arrival_rate: float
    prefill: int
    decode: int
    prefill_ready: int
    decode_ready: int
    ttft_p: float | None
    itl_p: float | None
    changes: list[str] = field(default_factory=list)


@dataclass
class ScaleEvent:
    """A change the simulator carried out: ``up`` (new pod), ``down`` (drain), ``cancel`` (a starting pod),
    ``switch`` (drain, then the other role)."""

    time_s: float
    kind: str
    role: str
    count: int


@dataclass
class SimResult:
    """What one run produced."""

    requests: list[SimRequest]
    intervals: list[IntervalRecord]
    events: list[ScaleEvent]
    gpu_hours: float
    end_s: float
    slo: SLO
    aborted: bool = False

    @property
    def completed(self) -> int:
        """Requests that got every output token."""
        return sum(1 for r in self.requests if r.finish is not None)

    @property
    def lost(self) -> int:
        """Requests never finished, or prefilled other than once, or short of tokens."""
        return sum(1 for r in self.requests
                   if r.finish is None or r.prefills != 1 or r.decoded != r.output)

    @property
    def goodput(self) -> float:
        """Fraction of requests meeting both SLOs."""
        return sum(1 for r in self.requests if r.meets(self.slo)) / max(1, len(self.requests))

    def percentile(self, attr: str, p: float | None = None) -> float:
        """A percentile of ``ttft`` or ``itl`` over every request."""
        return _percentile([getattr(r, attr) for r in self.requests], self.slo.percentile if p is None else p)


def _percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


class Simulation:
    """One run of a trace through a group, with an optional policy called every interval."""

    def __init__(self, trace: Sequence[TraceRequest], model: ServiceModel, group: GroupConfig, slo: SLO,
                 policy: Policy | None = None, max_failures: int | None = None) -> None:
        self.model = model
        self.group = group
        self.slo = slo
        self.policy = policy
        self.max_failures = max_failures
        cap = model.decode.kv_capacity_tokens
        self.requests = [SimRequest(i, r) for i, r in enumerate(sorted(trace, key=lambda r: r.arrival_s))]
        too_big = [r for r in self.requests if r.prompt + r.output > cap]
        if too_big:
            raise ValueError(f"{len(too_big)} requests need more KV than a decode engine holds ({cap} tokens)")
        self.t = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.eids = itertools.count()
        self.engines: list[Engine] = []
        self.gpus: list[Gpu] = []
        self.router: deque[SimRequest] = deque()
        self.events: list[ScaleEvent] = []
        self.intervals: list[IntervalRecord] = []
        self.done = 0
        self.failures = 0
        self.aborted = False
        self._ttfts: list[float] = []
        self._itls: list[float] = []
        self._arrived: list[SimRequest] = []
        self._lengths = (8000.0, 1000.0)
        self.last_arrival = self.requests[-1].arrival if self.requests else 0.0

    # ---- the event loop ----

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Schedule ``fn`` at time ``t``."""
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def run(self) -> SimResult:
        """Run to the last request's last token."""
        for _ in range(self.group.prefill):
            self._new_engine(PREFILL, 0.0, ready=True)
        for _ in range(self.group.decode):
            self._new_engine(DECODE, 0.0, ready=True)
        for r in self.requests:
            self.at(r.arrival, lambda r=r: self._arrive(r))
        self.at(self.group.interval_s, self._tick)
        while self.heap and not self.aborted:
            self.t, _, fn = heapq.heappop(self.heap)
            fn()
            if self.done == len(self.requests) and self.t >= self.last_arrival:
                break
        end = self.t
        for g in self.gpus:
            if g.stop is None:
                g.stop = end
        gpu_hours = sum(g.stop - g.start for g in self.gpus if g.stop is not None) / 3600
        return SimResult(self.requests, self.intervals, self.events, gpu_hours, end, self.slo, self.aborted)

    def _fail(self) -> None:
        self.failures += 1
        if self.max_failures is not None and self.failures > self.max_failures:
            self.aborted = True

    # ---- engines ----

    def _new_engine(self, role: str, t: float, ready: bool, gpu: Gpu | None = None) -> Engine:
        if gpu is None:
            gpu = Gpu(t)
            self.gpus.append(gpu)
        eid = next(self.eids)
        state = "ready" if ready else "starting"
        e: Engine = PrefillEngine(eid, gpu, state) if role == PREFILL else DecodeEngine(eid, gpu, state,
                                                                                       self.model.decode)
        self.engines.append(e)
        return e

    def _ready(self, e: Engine) -> None:
        if e.state != "starting" or e.cancelled:
            return
        e.state = "ready"
        if isinstance(e, DecodeEngine):
            e.tk = self.t
        self._dispatch()

    def _of(self, role: str, *states: str) -> list[Engine]:
        return [e for e in self.engines if e.role == role and e.state in states]

    def _drain(self, e: Engine) -> None:
        e.state = "draining"
        self._maybe_drained(e)

    def _maybe_drained(self, e: Engine) -> None:
        if e.state != "draining" or not e.idle():
            return
        e.state = "stopped"
        nxt = e.switch_to
        if nxt is None or nxt.cancelled:
            e.gpu.stop = self.t
        else:
            self.at(self.t + self.group.switch_s, lambda: self._ready(nxt))

    # ---- requests ----

    def _arrive(self, r: SimRequest) -> None:
        self._arrived.append(r)
        self.router.append(r)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.router:
            r = self.router[0]
            best_d: DecodeEngine | None = None
            for e in self.engines:
                if (isinstance(e, DecodeEngine) and e.state == "ready" and e.fits(r)
                        and (best_d is None or e.reserved_tokens < best_d.reserved_tokens)):
                    best_d = e
            if best_d is None:
                return
            best_p: PrefillEngine | None = None
            for e in self.engines:
                if isinstance(e, PrefillEngine) and e.state == "ready" and (best_p is None or e.work() < best_p.work()):
                    best_p = e
            if best_p is None:
                return
            self.router.popleft()
            best_d.reserved_tokens += r.prompt + r.output
            best_d.reserved_count += 1
            r.decode, r.prefill = best_d, best_p
            best_p.queue.append(r)
            best_p.queued_tokens += r.prompt
            if not best_p.busy:
                self._prefill_start(best_p)

    def _prefill_start(self, e: PrefillEngine) -> None:
        batch = [e.queue.popleft()]
        budget = self.group.prefill_token_budget
        tokens = batch[0].prompt
        while budget and e.queue and tokens + e.queue[0].prompt <= budget:
            nxt = e.queue.popleft()
            batch.append(nxt)
            tokens += nxt.prompt
        e.queued_tokens -= tokens
        e.busy_tokens = tokens
        e.busy = True
        seconds = self.model.prefill.batch_seconds([r.prompt for r in batch])
        self.at(self.t + seconds, lambda: self._prefill_done(e, batch))

    def _prefill_done(self, e: PrefillEngine, batch: list[SimRequest]) -> None:
        e.busy = False
        e.busy_tokens = 0
        landed = self.t + self.group.transfer_s
        for r in batch:
            r.prefills += 1
            r.prefill_end = self.t
            self.at(landed, lambda r=r: self._kv_landed(r))
        if e.queue:
            self._prefill_start(e)
        else:
            self._maybe_drained(e)
        self._dispatch()

    def _kv_landed(self, r: SimRequest) -> None:
        r.first_token = self.t
        r.decoded = 1
        self._ttfts.append(self.t - r.arrival)
        if self.t - r.arrival > self.slo.ttft_s:
            self._fail()
        d = r.decode
        assert d is not None
        if r.output <= 1:
            self._finish(d, r)
            return
        if d.b == 0:
            d.tk = self.t
            self._join(d, r)
            self._schedule(d)
        else:
            if not d.pending:
                d.pending_step = d.k + d.steps_by(self.t) + 1
            d.pending.append(r)
            self._schedule(d)

    def _join(self, d: DecodeEngine, r: SimRequest) -> None:
        r.join_step = d.k
        r.join_ctx = r.prompt + 1
        d.b += 1
        d.ctx_sum += r.join_ctx
        heapq.heappush(d.finishing, (d.k + r.output - 1, r.rid, r))

    def _schedule(self, d: DecodeEngine) -> None:
        d.version += 1
        if d.b == 0:
            return
        step = d.finishing[0][0]
        if d.pending:
            step = min(step, d.pending_step)
        v = d.version
        self.at(d.tk + d.duration(step - d.k), lambda: self._decode_event(d, v, step))

    def _decode_event(self, d: DecodeEngine, version: int, step: int) -> None:
        if version != d.version:
            return
        m = step - d.k
        d.ctx_sum += d.b * m
        d.k = step
        d.tk = self.t
        while d.finishing and d.finishing[0][0] <= d.k:
            _, _, r = heapq.heappop(d.finishing)
            d.b -= 1
            d.ctx_sum -= r.join_ctx + (d.k - r.join_step)
            r.decoded = r.output
            self._finish(d, r)
        if d.pending and (d.k >= d.pending_step or d.b == 0):
            for r in d.pending:
                self._join(d, r)
            d.pending.clear()
        self._schedule(d)

    def _finish(self, d: DecodeEngine, r: SimRequest) -> None:
        r.finish = self.t
        r.decoded = r.output
        self.done += 1
        d.reserved_tokens -= r.prompt + r.output
        d.reserved_count -= 1
        self._itls.append(r.itl)
        if r.itl > self.slo.itl_s:
            self._fail()
        self._maybe_drained(d)
        self._dispatch()

    # ---- the planner ----

    def _observe(self) -> Observation:
        iv = self.group.interval_s
        arrived, self._arrived = self._arrived, []
        if arrived:
            self._lengths = (sum(r.prompt for r in arrived) / len(arrived),
                             sum(r.output for r in arrived) / len(arrived))
        p = self.slo.percentile
        ttft = _percentile(self._ttfts, p) if self._ttfts else None
        itl = _percentile(self._itls, p) if self._itls else None
        self._ttfts, self._itls = [], []
        decodes = [e for e in self._of(DECODE, "ready") if isinstance(e, DecodeEngine)]
        cap = self.model.decode.kv_capacity_tokens
        return Observation(
            time_s=self.t, ttft_s=ttft, itl_s=itl,
            prefill_queue_tokens=sum(e.queued_tokens for e in self._of(PREFILL, "ready", "draining")
                                     if isinstance(e, PrefillEngine)),
            running_decodes=[e.b + len(e.pending) for e in decodes],
            kv_usage=[e.reserved_tokens / cap for e in decodes],
            arrival_rate=len(arrived) / iv, prompt_tokens=self._lengths[0], output_tokens=self._lengths[1],
            replicas={r: len(self._of(r, "starting", "ready")) for r in ROLES},
            ready={r: len(self._of(r, "ready")) for r in ROLES})

    def _tick(self) -> None:
        self.engines = [e for e in self.engines if e.state != "stopped"]
        obs = self._observe()
        changes: list[str] = []
        if self.policy is not None:
            decision = self.policy.decide(obs)
            self._apply(decision)
            changes = [f"{c.role} {c.before}->{c.after}: {c.reason}" for c in decision.changes]
        self.intervals.append(IntervalRecord(
            self.t, obs.arrival_rate, len(self._of(PREFILL, "starting", "ready")),
            len(self._of(DECODE, "starting", "ready")), len(self._of(PREFILL, "ready")),
            len(self._of(DECODE, "ready")), obs.ttft_s, obs.itl_s, changes))
        self.at(self.t + self.group.interval_s, self._tick)

    def _apply(self, decision: Decision) -> None:
        for sw in decision.switches:
            self._switch(sw.from_role, sw.to_role, sw.count)
        for role in ROLES:
            active = self._of(role, "starting", "ready")
            want = decision.replicas[role]
            if want > len(active):
                for _ in range(want - len(active)):
                    e = self._new_engine(role, self.t, ready=False)
                    self.at(self.t + self.group.startup_s, lambda e=e: self._ready(e))
                self.events.append(ScaleEvent(self.t, "up", role, want - len(active)))
            elif want < len(active):
                self._remove(role, len(active) - want)

    def _remove(self, role: str, count: int) -> None:
        starting = sorted(self._of(role, "starting"), key=lambda e: -e.gpu.start)
        for e in starting[:count]:
            e.cancelled = True
            e.state = "stopped"
            if e.switch_from is None:
                e.gpu.stop = self.t  # a pod still starting goes at once
            self.events.append(ScaleEvent(self.t, "cancel", role, 1))
        count -= min(count, len(starting))
        ready = sorted(self._of(role, "ready"), key=lambda e: e.work())
        for e in ready[:count]:
            self._drain(e)
            self.events.append(ScaleEvent(self.t, "down", role, 1))

    def _switch(self, from_role: str, to_role: str, count: int) -> None:
        # Pods still starting change role for free (the model is the same); then the least busy serving ones.
        starting = [e for e in self._of(from_role, "starting") if e.switch_from is None]
        for e in starting[:count]:
            e.state = "stopped"
            e.cancelled = True
            new = self._new_engine(to_role, self.t, ready=False, gpu=e.gpu)
            self.at(e.gpu.start + self.group.startup_s, lambda new=new: self._ready(new))
            self.events.append(ScaleEvent(self.t, "switch", to_role, 1))
        count -= min(count, len(starting))
        ready = sorted(self._of(from_role, "ready"), key=lambda e: e.work())
        for e in ready[:count]:
            new = self._new_engine(to_role, self.t, ready=False, gpu=e.gpu)
            new.switch_from = e
            e.switch_to = new
            self.events.append(ScaleEvent(self.t, "switch", to_role, 1))
            self._drain(e)


def simulate(trace: Sequence[TraceRequest], model: ServiceModel | None = None, group: GroupConfig | None = None,
             slo: SLO | None = None, policy: Policy | None = None, max_failures: int | None = None) -> SimResult:
    """Run ``trace`` through a group; ``policy`` None keeps the starting replicas (static)."""
    return Simulation(trace, model or default_model(), group or GroupConfig(), slo or SLO(), policy,
                      max_failures).run()


@dataclass(frozen=True)
class StaticResult:
    """The cheapest static split meeting the goodput target, and what the search ran."""

    prefill: int
    decode: int
    result: SimResult
    tried: int


def best_static(trace: Sequence[TraceRequest], model: ServiceModel | None = None, slo: SLO | None = None,
                goodput: float = 0.9, max_prefill: int = 16, max_decode: int = 16,
                group: GroupConfig | None = None) -> StaticResult | None:
    """Search static (P, D) by total replicas, fewest first; of the first total where some split meets
    ``goodput``, the one with the fewest GPU-hours. Runs that cannot reach the target stop early."""
    model = model or default_model()
    slo = slo or SLO()
    base = group or GroupConfig()
    allowed = math.floor((1 - goodput) * len(trace))
    tried = 0
    for total in range(2, max_prefill + max_decode + 1):
        found: list[StaticResult] = []
        for p in range(max(1, total - max_decode), min(max_prefill, total - 1) + 1):
            d = total - p
            g = GroupConfig(p, d, base.startup_s, base.switch_s, base.transfer_s, base.interval_s,
                            base.prefill_token_budget)
            res = simulate(trace, model, g, slo, None, max_failures=allowed)
            tried += 1
            if not res.aborted and res.goodput >= goodput:
                found.append(StaticResult(p, d, res, tried))
        if found:
            best = min(found, key=lambda s: s.result.gpu_hours)
            return StaticResult(best.prefill, best.decode, best.result, tried)
    return None


def planner_for(trace_group: GroupConfig, slo: SLO, model: ServiceModel, max_replicas: int = 16,
                **overrides: float) -> SLOPlanner:
    """An SLOPlanner whose config matches the simulated group's timings."""
    limits = {PREFILL: RoleLimits(1, max_replicas), DECODE: RoleLimits(1, max_replicas)}
    cfg = PlannerConfig(slo=slo, limits=limits, interval_s=trace_group.interval_s, startup_s=trace_group.startup_s,
                        transfer_s=trace_group.transfer_s, **overrides)  # type: ignore[arg-type]
    return SLOPlanner(cfg, model)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: the planner on a trace against the best static split; optionally a PNG."""
    ap = argparse.ArgumentParser(prog="python3 -P -m splitserve.planner.simulator", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="dynamo-10528", help="a named trace (dynamo-10528, oscillating) or a JSONL file")
    ap.add_argument("--profile", help="a bench engine report (JSON) to fit the service model from")
    ap.add_argument("--png", help="write a plot of load, replicas and TTFT here")
    ap.add_argument("--ttft", type=float, default=3.0, help="TTFT SLO, seconds")
    ap.add_argument("--itl", type=float, default=0.030, help="ITL SLO, seconds")
    ap.add_argument("--percentile", type=float, default=0.9)
    ap.add_argument("--prefill", type=int, default=1, help="starting prefill replicas")
    ap.add_argument("--decode", type=int, default=1, help="starting decode replicas")
    ap.add_argument("--startup", type=float, default=120.0, help="seconds a new pod takes")
    ap.add_argument("--interval", type=float, default=15.0, help="planner interval, seconds")
    ap.add_argument("--no-static", action="store_true", help="skip the static baseline search")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each decision")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from splitserve.planner.service_model import load_profile

    model = load_profile(args.profile) if args.profile else default_model()
    trace = load_trace(args.trace)
    slo = SLO(args.ttft, args.itl, args.percentile)
    group = GroupConfig(args.prefill, args.decode, startup_s=args.startup, interval_s=args.interval)
    res = simulate(trace, model, group, slo, planner_for(group, slo, model))
    pct = f"p{slo.percentile * 100:g}"
    ups = sum(e.count for e in res.events if e.kind == "up")
    downs = sum(e.count for e in res.events if e.kind in ("down", "cancel"))
    switches = sum(e.count for e in res.events if e.kind == "switch")
    print(f"trace {args.trace}: {len(trace)} requests over {trace[-1].arrival_s:.0f} s; SLO TTFT {slo.ttft_s} s, "
          f"ITL {slo.itl_s * 1e3:.0f} ms at {pct}; model: {model.source}")
    print(f"planner:  goodput {res.goodput:.1%}, {res.gpu_hours:.2f} GPU-hours, TTFT {pct} "
          f"{res.percentile('ttft'):.2f} s, ITL {pct} {res.percentile('itl') * 1e3:.1f} ms, "
          f"peak {max(i.prefill for i in res.intervals)}P {max(i.decode for i in res.intervals)}D, "
          f"{ups} pods started, {downs} removed, {switches} switched, {res.lost} lost")
    if not args.no_static:
        static = best_static(trace, model, slo, group=group)
        if static is None:
            print("static:   no split up to 16P 16D meets 90% goodput")
        else:
            s = static.result
            print(f"static:   best {static.prefill}P{static.decode}D: goodput {s.goodput:.1%}, "
                  f"{s.gpu_hours:.2f} GPU-hours ({static.tried} splits tried); "
                  f"planner/static GPU-hours {res.gpu_hours / s.gpu_hours:.2f}x")
    if args.png:
        from splitserve.planner.plot import write_png

        write_png(res, args.png, title=f"{args.trace}: planner")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
