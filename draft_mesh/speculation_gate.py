"""Whether the verifier speculates at all right now, from the token rates it measured (pure).

Each request's DraftPolicy (draft_mesh/draft_policy.py) says how many drafts it may take from how
often its drafts were accepted. Whether speculating pays is a property of the whole engine: while
it speculates, the overlap scheduler is off, every step sends commits, the drafters run on (and,
on one GPU, take turns with) the same device, steps wait for drafts, and a verify step of B
requests costs more than a plain one; it pays only if the tokens come faster for all that. So the
gate measures exactly that, per batch bucket: tokens emitted per second while speculating, and
while not (no drafts, no commits, drafters told to rest, overlap back on), each over its latest
stint, and keeps the mode that is faster.

A stint's first WARMUP_STEPS are not counted (the overlap pipeline refills; drafters catch up
with the commits they missed and get ahead again); a speculating stint counts from its first step
that verified drafts (a drafter first takes the requests in). A speculating stint that has verified
no drafts after UNPRIMED_STEPS steps (or whose budget is spent before its first verify) measured
nothing about speculating: it ends ("plain/no drafts") without a rate, without counting as a lost
probe, and with its budget charges refunded; speculating is tried again after RETRY_S of the gate's
clock, doubling at each such stint in a row (up to MAX_RETRY_S) and back to RETRY_S once a step
verifies drafts. A drafter that joined just before a load (its first syncs still prefilling when the
first probe ends) is thus tried again within tens of milliseconds, while one that never drafts costs
a few steps per MAX_RETRY_S. (Taken as a loss, such a probe kept speculating off for the rest of an
H200 benchmark run: 1.00x of plain where 1.64-2.09x were on offer at batch 1.)

The mode that wins is kept for PROBE_EVERY steps, then the other is tried for MEASURE_STEPS (fewer
when it is far behind): a drafter that got better (or a load under which it is cheaper) is found
again. Each probe that loses doubles the wait before the next (up to MAX_PROBE_EVERY), so a mode that
keeps losing costs less and less. Speculating that lost is also tried again once PROBE_AFTER_S
(scaled as the interval, doubling with it) have passed on the gate's clock since it lost, however
the steps went: a bucket's stint starts over whenever the batch moves to another bucket, and a load
whose batch keeps moving would otherwise never reach a probe (evidence that old, a drafter's
warm-up for one, no longer decides). A bucket that has not measured speculating yet tries it at
once, unless it lost at the nearest smaller bucket: then it waits for that bucket's probe interval.
Steps of a mode forced on the gate (K = 0) do not count towards the next probe, and a change of
drafters forgets what speculating measured (and any wait after stints without drafts).

With the speculation budget (on unless --no-speculation-budget), what speculating may cost on top of
that is bounded by measurement (draft_mesh/speculation_budget.py; its accounts are kept either way,
for /health and the metrics): a bucket decodes plainly until plain decoding's rate there is
measured, each speculating step (every one, and the plain steps right after a stint) is charged
what it lost against the best plain rate measured there, and speculating stops (and waits for the
headroom before it starts again, or for the budget's RECOVER_S) once the bucket's budget is spent.

The gate's clock (`clock`, time.monotonic unless a test injects one) times only the waits above; the
rates come from the step times the caller observes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.draft_mesh.speculation_budget import CAP_STEPS, MARGIN, LossBudget

SPECULATE, PLAIN = "speculate", "plain"
WARMUP_STEPS = 2
MEASURE_STEPS = 4
PROBE_EVERY = 64
MAX_PROBE_EVERY = 1024
PROBE_AFTER_S = 2.0  # seconds after speculating lost that it is probed again at the latest (x interval / PROBE_EVERY)
UNPRIMED_STEPS = 8  # steps a speculating stint waits for its first verified drafts before it ends as "no drafts"
RETRY_S = 0.05  # seconds before speculating is tried again after a stint with no drafts (doubling while they repeat)
MAX_RETRY_S = 10.0
EARLY_STEPS = 2  # a stint this far below the other mode's rate ends before MEASURE_STEPS
EARLY_GAP = 0.8


@dataclass
class Stint:
    """Tokens and seconds counted in the current run of steps of one mode and batch bucket."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    waited: int = 0  # steps before the stint started counting (speculating: before the first verify)
    verified: int = 0  # steps that verified drafts
    all_tokens: int = 0  # every step of the stint, the uncounted ones too
    all_seconds: float = 0.0
    after_speculating: bool = False  # a plain stint the gate switched to from speculating
    carried: bool = False  # a speculating stint the batch carried down into this bucket (requests finished)

    @property
    def rate(self) -> float | None:
        return self.rate_after(MEASURE_STEPS)

    def rate_after(self, steps: int) -> float | None:
        """Tokens per second over the counted steps, once there are `steps` of them."""
        counted = self.steps - WARMUP_STEPS
        return self.tokens / self.seconds if counted >= steps and self.seconds > 0 else None


@dataclass
class SpeculationGate:
    """The current mode, the stint in it, and each (bucket, mode)'s rate from its latest stint."""

    mode: str = ""  # the first: speculating, or with the budget plain (what speculating is charged against)
    bucket: int = 0
    stint: Stint = field(default_factory=Stint)
    rates: dict[tuple[int, str], float] = field(default_factory=dict)
    probe_every: dict[int, int] = field(default_factory=dict)
    probing: bool = False
    forced: bool = False  # the last steps ran a mode forced on the gate (K = 0), not one it chose
    # The loss budget (draft_mesh/speculation_budget.py): always accounted (/health shows what speculating
    # saved or lost), acted on only when `budgeted` (SpecConfig.speculation_budget: on unless
    # --no-speculation-budget; the dataclass's own default stays off, for the gate's unit tests).
    budgeted: bool = False
    margin: float = MARGIN
    cap_steps: float = CAP_STEPS
    budgets: dict[int, LossBudget] = field(default_factory=dict)
    # Plain decoding's best measured rate per bucket: what speculating is charged against (a plain stint
    # right after speculating, or beside a drafter's warm-up, measures low and would undercharge it).
    plain_best: dict[int, float] = field(default_factory=dict)
    switches: dict[str, int] = field(default_factory=dict)  # "mode/why": switches the gate made
    switched: list[tuple[str, str]] = field(default_factory=list)  # (mode, why) since the caller last took them
    observed_tokens: int = 0  # tokens of every step observed
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    # After a speculating stint that verified no drafts: speculating waits until retry_at, and the next
    # such stint in a row waits retry_s (doubled each time, up to MAX_RETRY_S; RETRY_S again once drafts verify).
    retry_at: float = float("-inf")
    retry_s: float = RETRY_S
    lost_at: dict[int, float] = field(default_factory=dict)  # the clock when speculating last lost, per bucket

    def __post_init__(self) -> None:
        self.mode = self.mode or (PLAIN if self.budgeted else SPECULATE)

    def observe(self, bucket: int, tokens: int, seconds: float, verified: bool = False) -> None:
        """A step of the current mode emitted `tokens` in `seconds` with `bucket` decoding requests
        (`verified`: it verified drafts)."""
        if bucket != self.bucket:  # another load: every stint starts over
            carried = self.mode == SPECULATE and 0 < bucket < self.bucket  # shrank: a run's tail, not new load
            self.bucket, self.stint, self.probing = bucket, Stint(carried=carried), False
        budget = self._budget(bucket)
        plain_rate = self.plain_best.get(bucket)
        if self.mode == PLAIN and not (self.stint.after_speculating and self.stint.steps < WARMUP_STEPS):
            budget.step(seconds)
        elif not self.forced and plain_rate:
            # A speculating step the gate chose, its first ones too, or one of the plain steps right after
            # speculating (the overlap pipeline refills, the drafters' last steps still hold the device).
            budget.step(seconds, tokens, plain_rate)
        self.stint.all_tokens += tokens
        self.stint.all_seconds += seconds
        self.observed_tokens += tokens
        if self.mode == SPECULATE and self.stint.steps == 0 and not verified:
            self.stint.waited += 1  # no drafts yet: the drafter is still taking the requests in (decide() ends
            return  # the stint as "no drafts" after UNPRIMED_STEPS)
        if verified:
            self.stint.verified += 1
            self.retry_s = RETRY_S  # the drafters draft: a later stint without drafts is retried soon again
        self.stint.steps += 1
        if self.stint.steps > WARMUP_STEPS and seconds > 0:
            self.stint.tokens += tokens
            self.stint.seconds += seconds
        rate = self.stint.rate
        if rate is not None:
            self._measured(bucket, rate)

    def _measured(self, bucket: int, rate: float) -> None:
        """The current stint's `rate` is its mode's in `bucket`; a plain one also gives the bucket's plain step
        time (its budget's cap) and best plain rate, whether the stint ran its MEASURE_STEPS or ended early."""
        self.rates[(bucket, self.mode)] = rate
        if self.mode == PLAIN:
            self._budget(bucket).plain_step(self.stint.seconds / (self.stint.steps - WARMUP_STEPS))
            self.plain_best[bucket] = max(rate, self.plain_best.get(bucket, 0.0))

    def forget_speculation(self) -> None:
        """The drafters changed (one joined or left): speculating rates measured with the others say
        nothing about them, so each bucket measures speculation again before it trusts either mode."""
        self.rates = {key: rate for key, rate in self.rates.items() if key[1] != SPECULATE}
        self.probe_every.clear()
        self.lost_at.clear()
        self.retry_at, self.retry_s = float("-inf"), RETRY_S
        if self.mode == SPECULATE:  # the stint so far ran with the drafters before
            self.stint = Stint()

    def force(self, mode: str) -> None:
        """Runs `mode` whatever the rates say (K = 0 means plain decoding); its rate is still measured."""
        if mode != self.mode:
            self.mode, self.stint, self.probing = mode, Stint(), False
        self.forced = True

    def decide(self) -> str:
        """The mode of the next step (call once per step, after `observe`)."""
        if self.forced:  # steps the gate did not choose do not bring its next probe closer
            self.forced = False
            self.stint.steps = min(self.stint.steps, WARMUP_STEPS + MEASURE_STEPS)
        budget = self._budget(self.bucket)
        # Speculating starts only where plain decoding's rate is measured (what it is charged against). A
        # stint the batch carried down into a bucket without one (requests finished) goes on, uncharged
        # there, and the rates decide: stopping it (a run's last requests, left at smaller and smaller
        # buckets as they finish) made each of them decode its remaining tokens one a step (on the H200,
        # batch 32 K=8: 25 such steps, 0.94x). A batch that grows into one (new requests, a new burst after
        # an idle spell) decodes plainly there first, as the budget says.
        unmeasured = (self.bucket, PLAIN) not in self.rates
        if self.budgeted and self.mode == SPECULATE and unmeasured and not self.stint.carried:
            self._switch(PLAIN, probing=False, why="unmeasured")
            return self.mode
        # Before the stint's first verify step (the drafters take the requests in) a step says nothing of
        # the next ones: only an overdrawn budget ends it then, and a stint that ends so, or that waited
        # UNPRIMED_STEPS for drafts, measured nothing about speculating (no drafts: no evidence).
        unprimed = self.stint.steps == 0
        charged = self.budgeted and budget.headroom_s is not None
        if self.mode == SPECULATE and unprimed and (
                self.stint.waited >= UNPRIMED_STEPS or (charged and not budget.can_continue(predict=False))):
            self._no_drafts(budget)
            return self.mode
        # Its loss spent the bucket's budget.
        if charged and self.mode == SPECULATE and not budget.can_continue(predict=not unprimed):
            spent = self.stint.all_tokens / self.stint.all_seconds if self.stint.all_seconds > 0 else 0.0
            self.rates[(self.bucket, SPECULATE)] = min(self.rates.get((self.bucket, SPECULATE), spent), spent)
            if self.probing:
                self.probe_every[self.bucket] = min(2 * self.probe_every.get(self.bucket, PROBE_EVERY),
                                                    MAX_PROBE_EVERY)
            self.lost_at[self.bucket] = self.clock()
            self._switch(PLAIN, probing=False, why="budget")
            return self.mode
        other = PLAIN if self.mode == SPECULATE else SPECULATE
        mine, theirs = self.rates.get((self.bucket, self.mode)), self.rates.get((self.bucket, other))
        early = self.stint.rate_after(EARLY_STEPS)
        if self.stint.rate is None:
            if early is not None and theirs is not None and early < EARLY_GAP * theirs:
                mine = early  # clearly slower: no need to finish
                self._measured(self.bucket, early)
            else:
                return self.mode  # still measuring this stint
        if other == SPECULATE and self.clock() < self.retry_at:
            return self.mode  # the last stint had no drafts: speculating is tried again once its retry is due
        if self.budgeted and other == SPECULATE and not budget.can_start():
            return self.mode  # plain until its steps have saved the headroom to try speculating (or the debt is old)
        every = self.probe_every.get(self.bucket, PROBE_EVERY)
        lost_below = self._lost_below() if theirs is None and other == SPECULATE else None
        if theirs is not None and mine is not None and theirs > mine:
            if self.probing:  # the probe lost: back, and probe less often
                self.probe_every[self.bucket] = min(2 * every, MAX_PROBE_EVERY)
            if other == PLAIN:
                self.lost_at[self.bucket] = self.clock()
            self._switch(other, probing=False, why="probe lost" if self.probing else "faster")
        elif lost_below is not None:  # speculating lost at a smaller batch: it is probed here when due
            below_every, below_lost_at = lost_below
            if self.stint.steps >= below_every + WARMUP_STEPS or self._aged(below_lost_at, below_every):
                self._switch(other, probing=True, why="probe")
        elif (theirs is None or self.stint.steps >= every + WARMUP_STEPS
              or (other == SPECULATE and self._aged(self.lost_at.get(self.bucket), every))):
            if self.probing:  # the probe won: it is the mode now
                self.probe_every[self.bucket] = PROBE_EVERY
            self._switch(other, probing=True, why="probe")  # measure (again) the mode not running
        elif self.probing:
            self.probing = False
            self.probe_every[self.bucket] = PROBE_EVERY
        return self.mode

    def _lost_below(self) -> tuple[int, float | None] | None:
        """Where speculating measured slower than plain at the nearest smaller bucket that measured
        both, that bucket's probe interval and when it lost there (a verify step's cost grows with the
        batch, and a drafter's share of the device with it: speculating that lost at a smaller batch is
        not tried at once at a larger one); else None."""
        measured = [b for (b, mode) in self.rates if mode == SPECULATE and b < self.bucket and (b, PLAIN) in self.rates]
        if not measured:
            return None
        nearest = max(measured)
        if self.rates[(nearest, SPECULATE)] >= self.rates[(nearest, PLAIN)]:
            return None
        return self.probe_every.get(nearest, PROBE_EVERY), self.lost_at.get(nearest)

    def _aged(self, lost_at: float | None, every: int) -> bool:
        """Speculating lost at `lost_at` (the clock), long enough ago for a probe whose interval is `every` steps."""
        return lost_at is not None and self.clock() - lost_at >= PROBE_AFTER_S * every / PROBE_EVERY

    def _no_drafts(self, budget: LossBudget) -> None:
        """The speculating stint verified no drafts: plain again, no rate taken, its budget charges refunded,
        and speculating tried again after the retry wait (which doubles while such stints repeat)."""
        budget.refund()
        self.retry_at = self.clock() + self.retry_s
        self.retry_s = min(2 * self.retry_s, MAX_RETRY_S)
        self._switch(PLAIN, probing=False, why="no drafts")
        self.stint.after_speculating = False  # nor are the plain steps right after it charged to speculating

    def summary(self) -> dict[str, Any]:
        """What the gate decided and why, for /health: the mode, each bucket's rates, budget and
        probe interval, and the switches made so far by reason."""
        buckets: dict[str, dict[str, Any]] = {}
        for bucket in sorted({b for b, _ in self.rates} | set(self.budgets)):
            budget = self.budgets.get(bucket, LossBudget())
            speculate, plain = self.rates.get((bucket, SPECULATE)), self.rates.get((bucket, PLAIN))
            buckets[str(bucket)] = {
                "speculate_tokens_per_s": round(speculate, 1) if speculate else None,
                "plain_tokens_per_s": round(plain, 1) if plain else None,
                "headroom_ms": None if budget.headroom_s is None else round(1e3 * budget.headroom_s, 3),
                "cap_ms": round(1e3 * budget.cap_s, 3), "saved_ms": round(1e3 * budget.saved_s, 3),
                "probe_every": self.probe_every.get(bucket, PROBE_EVERY), "debts_forgiven": budget.forgiven}
        retry_in = self.retry_at - self.clock()
        return {"mode": self.mode, "bucket": self.bucket, "probing": self.probing, "buckets": buckets,
                "switches": dict(self.switches), "retry_in_ms": round(1e3 * retry_in, 1) if retry_in > 0 else None}

    def _budget(self, bucket: int) -> LossBudget:
        if bucket not in self.budgets:
            self.budgets[bucket] = LossBudget(margin=self.margin, cap_steps=self.cap_steps, clock=self.clock)
        return self.budgets[bucket]

    def _switch(self, mode: str, probing: bool, why: str) -> None:
        self.mode, self.stint, self.probing = mode, Stint(after_speculating=self.mode == SPECULATE), probing
        if mode == SPECULATE:
            self._budget(self.bucket).started(forgive=self.budgeted)
        key = f"{mode}/{why}"
        self.switches[key] = self.switches.get(key, 0) + 1
        self.switched.append((mode, why))
