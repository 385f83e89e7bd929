"""The SLO planner's decision loop: from one interval's observations to desired prefill and decode replicas.

Pure: no clock, no Kubernetes, no Prometheus. Each interval the caller hands ``SLOPlanner.decide`` an
``Observation`` and applies the returned ``Decision`` (through each role's ``/scale`` subresource in the operator,
or to the simulated group in ``simulator.py``).

How it decides, per interval:

1. **Predict.** The arrival rate is fitted with a line over the last ``trend_intervals`` intervals. Scaling up looks
   ``startup_s + interval_s`` ahead (when a pod started now would serve); scaling down takes the larger of the recent
   rates and that prediction, so a pool is not given back just before the load it will need returns.
2. **Size prefill** as a queue: one replica serves ``1 / prefill_seconds(prompt)`` requests per second; the count is
   the fewest replicas whose waiting time at the SLO percentile (Erlang C, M/M/c, scaled by ``(1 + cv^2) / 2`` for
   less variable service) fits in ``ttft_s - prefill_seconds - transfer_s``, with utilization at most
   ``prefill_utilization``, plus what drains a standing backlog of queued prompt tokens.
3. **Size decode** by concurrency: the batch per replica is the largest whose step time at the mean context stays
   within ``itl_headroom * itl_s`` and whose KV reservations fit; the concurrency is Little's law (rate x time a
   request holds a decode slot); replicas = concurrency / (batch x ``decode_utilization``), and never fewer than
   the running decodes observed need.
4. **React** when the observed percentile breaches although the model says the pool is enough (the model is off):
   one more replica of the role to blame, but only while none of that role is already starting.
5. **Hysteresis.** Scale up at once. Scale down only after ``scale_down_intervals`` consecutive intervals in which
   even the conservative sizing (the down rate, lower utilizations) needs fewer replicas, to the largest of those
   needs; then the window restarts.
6. **Switch.** When a role needs more replicas now while the other has a surplus by the conservative sizing
   (idle), the decision moves replicas across (a role switch: seconds, no reload) before asking for new pods
   (minutes).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splitserve.planner.service_model import ServiceModel, default_model

logger = logging.getLogger(__name__)

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


def other(role: str) -> str:
    """The other of prefill and decode."""
    return DECODE if role == PREFILL else PREFILL


@dataclass(frozen=True)
class SLO:
    """Latency targets at a percentile of requests: TTFT and mean inter-token latency."""

    ttft_s: float = 3.0
    itl_s: float = 0.030
    percentile: float = 0.9


@dataclass(frozen=True)
class RoleLimits:
    """Bounds on one role's replicas."""

    min: int = 1
    max: int = 16


@dataclass(frozen=True)
class Observation:
    """What the planner sees of one interval (in the operator: Prometheus over the last interval).

    ``ttft_s`` and ``itl_s`` are the observed values at the SLO percentile (None: no samples). ``replicas`` counts
    each role's replicas serving or on their way (ready + starting); ``ready`` those serving (default: all)."""

    time_s: float
    ttft_s: float | None
    itl_s: float | None
    prefill_queue_tokens: int
    running_decodes: Sequence[int]
    kv_usage: Sequence[float]
    arrival_rate: float
    prompt_tokens: float
    output_tokens: float
    replicas: Mapping[str, int]
    ready: Mapping[str, int] | None = None

    def ready_count(self, role: str) -> int:
        """Replicas of ``role`` serving now."""
        return self.replicas[role] if self.ready is None else self.ready[role]


@dataclass(frozen=True)
class PlannerConfig:
    """Targets, bounds and the knobs of the decision loop."""

    slo: SLO = SLO()
    limits: Mapping[str, RoleLimits] = field(default_factory=lambda: {PREFILL: RoleLimits(), DECODE: RoleLimits()})
    interval_s: float = 15.0
    startup_s: float = 120.0  # a new pod, until it serves: the prediction horizon
    transfer_s: float = 0.05
    trend_intervals: int = 8
    trend_fit_weighting: bool = False  # extrapolate slope * R^2 of the fitted line (steadier, later on ramps)
    trend_damping: float = 1.0  # share of the fitted trend extrapolated over the horizon
    trend_short_intervals: int = 0
    down_horizon_s: float = 60.0
    rate_z: float = 2.0  # standard errors of the fitted level added to it
    rate_margin: float = 0.05  # headroom on the fitted rate, for what the trend cannot see yet
    prefill_utilization: float = 0.95
    prefill_down_utilization: float = 0.85
    service_cv2: float = 0.5  # squared coefficient of variation of prefill service (0: fixed lengths)
    itl_headroom: float = 0.85
    decode_utilization: float = 0.95
    decode_throughput_utilization: float = 0.7  # of a replica's ceiling (1 / per-token step cost at the context)
    decode_down_utilization: float = 0.75
    kv_target: float = 0.9
    kv_high: float = 0.9  # KV usage above which a TTFT breach is blamed on decode (prefill waits on its pages)
    backlog_drain_s: float = 60.0
    scale_down_intervals: int = 4
    allow_switch: bool = True


@dataclass(frozen=True)
class RoleChange:
    """One role's replicas changing, why, and how many of the added ones come by role switch."""

    role: str
    before: int
    after: int
    reason: str
    via_switch: int = 0


@dataclass(frozen=True)
class RoleSwitch:
    """Idle replicas of ``from_role`` to be switched to ``to_role`` (seconds, no reload) instead of new pods."""

    from_role: str
    to_role: str
    count: int
    reason: str


@dataclass(frozen=True)
class Decision:
    """Desired replicas per role, a reason for each change, and the role switches preferred over new pods."""

    replicas: dict[str, int]
    changes: list[RoleChange]
    switches: list[RoleSwitch]
    predicted_rate: float

    @property
    def prefer_switch(self) -> bool:
        """True when some of the change is better made by switching idle engines than by starting pods."""
        return bool(self.switches)


def erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in an M/M/c queue of ``servers`` at offered ``load`` (erlangs)."""
    if load <= 0:
        return 0.0
    if load >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):  # Erlang B, by recursion
        b = load * b / (k + load * b)
    rho = load / servers
    return b / (1 - rho + rho * b)


def wait_quantile(servers: int, rate: float, service_rate: float, percentile: float) -> float:
    """Waiting time at ``percentile`` in an M/M/c queue (infinite when overloaded)."""
    if rate <= 0:
        return 0.0
    if rate >= servers * service_rate:
        return math.inf
    waits = erlang_c(servers, rate / service_rate)
    if waits <= 1 - percentile:
        return 0.0
    return math.log(waits / (1 - percentile)) / (servers * service_rate - rate)


def plan_switches(target: Mapping[str, int], current: Mapping[str, int], idle_need: Mapping[str, int],
                  limits: Mapping[str, RoleLimits], startup_s: float) -> list[RoleSwitch]:
    """The role switches to prefer over new pods: when a role's target is above its replicas while the
    other role has more replicas than even its conservative sizing (`idle_need`) and its minimum ask
    for, the shortfall (up to that surplus) comes from switching those idle engines across (seconds,
    no weight reload) instead of pods that take `startup_s` to serve."""
    switches = []
    for role in ROLES:
        donor = other(role)
        deficit = target[role] - current[role]
        surplus = current[donor] - max(idle_need[donor], limits[donor].min)
        if deficit > 0 and surplus > 0:
            k = min(deficit, surplus)
            switches.append(RoleSwitch(donor, role, k, (
                f"{donor} idle ({current[donor]} serving, {idle_need[donor]} needed) while {role} needs "
                f"{target[role]}: switch {k} ({startup_s:.0f} s for a new pod)")))
    return switches


class SLOPlanner:
    """Sizes prefill and decode to TTFT and ITL targets, one ``decide`` call per interval (keeps the rate history
    and the scale-down windows between calls)."""

    def __init__(self, config: PlannerConfig | None = None, model: ServiceModel | None = None) -> None:
        self.config = config or PlannerConfig()
        self.model = model or default_model()
        self._rates: deque[tuple[float, float]] = deque(maxlen=max(2, self.config.trend_intervals,
                                                                   self.config.trend_short_intervals))
        self._down_needs: dict[str, list[int]] = {PREFILL: [], DECODE: []}
        self.slope = 0.0  # the last fitted trend, req/s per second

    # ---- prediction ----

    @staticmethod
    def _fit(points: Sequence[tuple[float, float]], time_s: float) -> tuple[float, float, float]:
        """Least-squares line through (time, rate) points: (value at ``time_s``, slope, R^2 of the line)."""
        n = len(points)
        mt = sum(t for t, _ in points) / n
        mr = sum(r for _, r in points) / n
        var = sum((t - mt) ** 2 for t, _ in points)
        slope = sum((t - mt) * (r - mr) for t, r in points) / var if var > 0 else 0.0
        total = sum((r - mr) ** 2 for _, r in points)
        resid = sum((r - mr - slope * (t - mt)) ** 2 for t, r in points)
        r2 = 1 - resid / total if total > 0 else 0.0
        return max(0.0, mr + slope * (time_s - mt)), slope, r2

    def predict(self, time_s: float, rate: float) -> tuple[float, float]:
        """Record this interval's rate; return (rate to scale up for, rate to scale down to).

        The level and trend are a line fitted over the last ``trend_intervals`` (with ``trend_short_intervals``,
        the steeper of that and a line over fewer, quicker to see a ramp start). Scaling up plans for the trend
        ``startup_s + interval_s`` ahead (when a pod asked for now serves), scaling down ``down_horizon_s`` ahead;
        both add ``rate_z`` standard errors of the level (Poisson counts) and ``rate_margin`` of it."""
        cfg = self.config
        self._rates.append((time_s, rate))
        history = list(self._rates)[-cfg.trend_intervals:]
        if len(history) < 2:
            level, slope = rate, 0.0
        else:
            level, slope, r2 = self._fit(history, time_s)
            if cfg.trend_short_intervals >= 3 and len(history) >= 3:
                slope = max(slope, self._fit(history[-cfg.trend_short_intervals:], time_s)[1])
            if cfg.trend_fit_weighting:
                slope *= max(0.0, r2)  # a line that explains little of the window (a V, a blip) is not a trend
        self.slope = slope
        noise = cfg.rate_z * math.sqrt(max(level, 0.1) / (len(history) * cfg.interval_s)) + cfg.rate_margin * level
        horizon = (cfg.startup_s + cfg.interval_s) * cfg.trend_damping
        up = level + max(0.0, slope * horizon) + noise
        down = max(level + max(0.0, slope * cfg.down_horizon_s) + noise, rate)  # never below what just arrived
        return up, down

    # ---- sizing ----

    def prefill_needed(self, rate: float, prompt_tokens: float, queue_tokens: float, utilization: float,
                       limit: int) -> tuple[int, str]:
        """Fewest prefill replicas (<= limit) meeting the TTFT target at ``rate``, and the sizing in words."""
        cfg, slo = self.config, self.config.slo
        service = self.model.prefill.seconds(max(prompt_tokens, 1.0))
        budget = slo.ttft_s - service - cfg.transfer_s
        note = ""
        if budget <= 0.05 * slo.ttft_s:
            note = f" (a {prompt_tokens:.0f}-token prefill alone takes {service:.2f} s of the {slo.ttft_s} s TTFT)"
            budget = 0.05 * slo.ttft_s
        mu = 1.0 / service
        scale = (1 + cfg.service_cv2) / 2
        need = limit
        for c in range(1, limit + 1):
            if rate / (c * mu) > utilization:
                continue
            if wait_quantile(c, rate, mu, slo.percentile) * scale <= budget:
                need = c
                break
        per_replica = self.model.prefill.tokens_per_s(max(prompt_tokens, 1.0))
        backlog = math.ceil((rate * prompt_tokens + queue_tokens / cfg.backlog_drain_s) / (per_replica * utilization))
        why = f"{rate:.2f} req/s x {prompt_tokens:.0f} prompt tokens at {per_replica:.0f} tok/s a replica{note}"
        if backlog > need:
            why += f", {queue_tokens:.0f} queued prompt tokens to drain"
        return min(limit, max(need, backlog, 1)), why

    def decode_batch(self, prompt_tokens: float, output_tokens: float) -> int:
        """Sequences one decode replica may run within the ITL target and its KV pool."""
        dm, cfg = self.model.decode, self.config
        context = prompt_tokens + output_tokens / 2
        by_itl = dm.max_batch_within(cfg.itl_headroom * cfg.slo.itl_s, context)
        by_kv = math.floor(dm.kv_capacity_tokens * cfg.kv_target / max(1.0, prompt_tokens + output_tokens))
        return max(1, min(by_itl, by_kv))

    def decode_needed(self, rate: float, prompt_tokens: float, output_tokens: float, running: int,
                      utilization: float, limit: int) -> tuple[int, str]:
        """Fewest decode replicas (<= limit) holding the concurrency ``rate`` brings within the ITL target."""
        dm, cfg = self.model.decode, self.config
        batch = self.decode_batch(prompt_tokens, output_tokens)
        context = prompt_tokens + output_tokens / 2
        steps = max(output_tokens, 1.0) - 1
        # A request holds a decode slot from dispatch: its prefill, the transfer, then `steps` steps whose time
        # grows with the batch. Per replica at `replicas`, the batch n solves n = r (steps * step(n) + rest),
        # r = rate / replicas; step(n) = fixed + slope * n.
        rest = self.model.prefill.seconds(max(prompt_tokens, 1.0)) + cfg.transfer_s
        fixed = dm.fixed
        slope = dm.per_seq + dm.per_token * context
        need = limit
        per_replica = 0.0
        for replicas in range(1, limit + 1):
            r = rate / replicas
            denom = 1 - r * steps * slope  # 1 - this replica's share of its token-rate ceiling
            if denom <= 1 - cfg.decode_throughput_utilization:
                continue
            per_replica = r * (steps * fixed + rest) / denom
            if per_replica <= batch * utilization:
                need = replicas
                break
        step = dm.step_seconds(per_replica, context)
        why = (f"{rate:.2f} req/s x {steps:.0f} steps: {per_replica:.0f} decodes a replica at "
               f"{step * 1e3:.1f} ms a step (at most {batch} within the ITL target and KV)")
        if running > need * batch:
            need = math.ceil(running / batch)
            why = f"{running} running decodes at most {batch} a replica"
        return min(limit, max(need, 1)), why

    # ---- the decision ----

    def decide(self, obs: Observation) -> Decision:
        """Desired replicas per role for this interval's observation."""
        cfg, slo = self.config, self.config.slo
        up_rate, down_rate = self.predict(obs.time_s, obs.arrival_rate)
        current = {r: int(obs.replicas[r]) for r in ROLES}
        lim = {r: cfg.limits[r] for r in ROLES}
        running = int(sum(obs.running_decodes))
        prompt, output = obs.prompt_tokens, obs.output_tokens
        up_p, why_p = self.prefill_needed(up_rate, prompt, obs.prefill_queue_tokens, cfg.prefill_utilization,
                                          lim[PREFILL].max)
        up_d, why_d = self.decode_needed(up_rate, prompt, output, running, cfg.decode_utilization, lim[DECODE].max)
        down_p, _ = self.prefill_needed(down_rate, prompt, obs.prefill_queue_tokens, cfg.prefill_down_utilization,
                                        lim[PREFILL].max)
        down_d, _ = self.decode_needed(down_rate, prompt, output, running, cfg.decode_down_utilization,
                                       lim[DECODE].max)
        up = {PREFILL: up_p, DECODE: up_d}
        down = {PREFILL: max(up_p, down_p), DECODE: max(up_d, down_d)}
        why = {PREFILL: why_p, DECODE: why_d}

        # React to a breach the model did not foresee, blaming the role that causes it.
        kv_mean = sum(obs.kv_usage) / len(obs.kv_usage) if obs.kv_usage else 0.0
        ttft_breach = obs.ttft_s is not None and obs.ttft_s > slo.ttft_s
        itl_breach = obs.itl_s is not None and obs.itl_s > slo.itl_s
        pct = f"p{slo.percentile * 100:g}"
        if ttft_breach:
            blame = DECODE if kv_mean >= cfg.kv_high else PREFILL
            if up[blame] <= current[blame] and obs.ready_count(blame) >= current[blame]:
                up[blame] = current[blame] + 1
                why[blame] = f"TTFT {pct} {obs.ttft_s:.2f} s > {slo.ttft_s} s" + (
                    f" with KV {kv_mean:.0%} used (prefill waits on decode pages)" if blame == DECODE
                    else f" with {obs.prefill_queue_tokens} prompt tokens queued")
        if itl_breach and up[DECODE] <= current[DECODE] and obs.ready_count(DECODE) >= current[DECODE]:
            up[DECODE] = current[DECODE] + 1
            why[DECODE] = f"ITL {pct} {obs.itl_s * 1e3:.1f} ms > {slo.itl_s * 1e3:.0f} ms"

        target: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for role in ROLES:
            up[role] = min(lim[role].max, max(lim[role].min, up[role]))
            down[role] = min(lim[role].max, max(lim[role].min, down[role]))
            if up[role] > current[role]:
                target[role] = up[role]
                reasons[role] = f"scale up: {why[role]}"
                self._down_needs[role].clear()
            elif down[role] < current[role] and self.slope <= 0:
                needs = self._down_needs[role]
                needs.append(down[role])
                if len(needs) >= cfg.scale_down_intervals:
                    target[role] = max(needs)
                    reasons[role] = (f"scale down: {len(needs)} intervals ({len(needs) * cfg.interval_s:.0f} s) "
                                     f"needing at most {target[role]} for {down_rate:.2f} req/s")
                    needs.clear()
                else:
                    target[role] = current[role]
            else:
                self._down_needs[role].clear()
                target[role] = current[role]
            target[role] = min(lim[role].max, max(lim[role].min, target[role]))

        # One pool short while the other idles: switch engines across before starting pods.
        switches = plan_switches(target, current, down, lim, cfg.startup_s) if cfg.allow_switch else []
        via: dict[str, int] = {PREFILL: 0, DECODE: 0}
        for sw in switches:
            target[sw.from_role] = min(target[sw.from_role], current[sw.from_role] - sw.count)
            self._down_needs[sw.from_role].clear()
            via[sw.to_role] = sw.count
            reasons[sw.from_role] = (f"switch {sw.count} to {sw.to_role}: {sw.from_role} needs "
                                     f"{max(down[sw.from_role], lim[sw.from_role].min)}")
        changes = [RoleChange(r, current[r], target[r], reasons.get(r, ""), via[r])
                   for r in ROLES if target[r] != current[r]]
        for ch in changes:
            logger.info("planner t=%.0f %s %d -> %d: %s", obs.time_s, ch.role, ch.before, ch.after, ch.reason)
        return Decision(target, changes, switches, up_rate)
