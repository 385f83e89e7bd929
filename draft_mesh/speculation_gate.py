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
that verified drafts (a drafter first takes the requests in, at most UNPRIMED_STEPS steps). The
mode that wins is kept for PROBE_EVERY steps, then the other is tried for MEASURE_STEPS (fewer when it is far behind): a
drafter that got better (or a load under which it is cheaper) is found again. Each probe that
loses doubles the wait before the next (up to MAX_PROBE_EVERY), so a mode that keeps losing costs
less and less. A bucket that has not measured speculating yet tries it at once, unless it lost at
the nearest smaller bucket: then it waits for that bucket's probe interval. Steps of a mode forced
on the gate (K = 0) do not count towards the next probe, and a change of drafters forgets what
speculating measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATE, PLAIN = "speculate", "plain"
WARMUP_STEPS = 2
MEASURE_STEPS = 4
PROBE_EVERY = 64
MAX_PROBE_EVERY = 1024
UNPRIMED_STEPS = 4
EARLY_STEPS = 2  # a stint this far below the other mode's rate ends before MEASURE_STEPS
EARLY_GAP = 0.8


@dataclass
class Stint:
    """Tokens and seconds counted in the current run of steps of one mode and batch bucket."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    waited: int = 0  # steps before the stint started counting (speculating: before the first verify)

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

    mode: str = SPECULATE
    bucket: int = 0
    stint: Stint = field(default_factory=Stint)
    rates: dict[tuple[int, str], float] = field(default_factory=dict)
    probe_every: dict[int, int] = field(default_factory=dict)
    probing: bool = False
    forced: bool = False  # the last steps ran a mode forced on the gate (K = 0), not one it chose

    def observe(self, bucket: int, tokens: int, seconds: float, verified: bool = False) -> None:
        """A step of the current mode emitted `tokens` in `seconds` with `bucket` decoding requests
        (`verified`: it verified drafts)."""
        if bucket != self.bucket:  # another load: every stint starts over
            self.bucket, self.stint, self.probing = bucket, Stint(), False
        if self.mode == SPECULATE and self.stint.steps == 0 and not verified and self.stint.waited < UNPRIMED_STEPS:
            self.stint.waited += 1  # no drafts yet: the drafter is still taking the requests in
            return
        self.stint.steps += 1
        if self.stint.steps > WARMUP_STEPS and seconds > 0:
            self.stint.tokens += tokens
            self.stint.seconds += seconds
        rate = self.stint.rate
        if rate is not None:
            self.rates[(bucket, self.mode)] = rate

    def forget_speculation(self) -> None:
        """The drafters changed (one joined or left): speculating rates measured with the others say
        nothing about them, so each bucket measures speculation again before it trusts either mode."""
        self.rates = {key: rate for key, rate in self.rates.items() if key[1] != SPECULATE}
        self.probe_every.clear()

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
        other = PLAIN if self.mode == SPECULATE else SPECULATE
        mine, theirs = self.rates.get((self.bucket, self.mode)), self.rates.get((self.bucket, other))
        early = self.stint.rate_after(EARLY_STEPS)
        if self.stint.rate is None:
            if early is not None and theirs is not None and early < EARLY_GAP * theirs:
                mine = self.rates[(self.bucket, self.mode)] = early  # clearly slower: no need to finish
            else:
                return self.mode  # still measuring this stint
        every = self.probe_every.get(self.bucket, PROBE_EVERY)
        lost_below = self._lost_below() if theirs is None and other == SPECULATE else None
        if theirs is not None and mine is not None and theirs > mine:
            if self.probing:  # the probe lost: back, and probe less often
                self.probe_every[self.bucket] = min(2 * every, MAX_PROBE_EVERY)
            self._switch(other, probing=False)
        elif lost_below is not None:  # speculating lost at a smaller batch: it is probed here when due
            if self.stint.steps >= lost_below + WARMUP_STEPS:
                self._switch(other, probing=True)
        elif theirs is None or self.stint.steps >= every + WARMUP_STEPS:
            if self.probing:  # the probe won: it is the mode now
                self.probe_every[self.bucket] = PROBE_EVERY
            self._switch(other, probing=True)  # measure (again) the mode not running
        elif self.probing:
            self.probing = False
            self.probe_every[self.bucket] = PROBE_EVERY
        return self.mode

    def _lost_below(self) -> int | None:
        """Where speculating measured slower than plain at the nearest smaller bucket that measured
        both, that bucket's probe interval (a verify step's cost grows with the batch, and a
        drafter's share of the device with it: speculating that lost at a smaller batch is not
        tried at once at a larger one); else None."""
        measured = [b for (b, mode) in self.rates if mode == SPECULATE and b < self.bucket and (b, PLAIN) in self.rates]
        if not measured:
            return None
        nearest = max(measured)
        if self.rates[(nearest, SPECULATE)] >= self.rates[(nearest, PLAIN)]:
            return None
        return self.probe_every.get(nearest, PROBE_EVERY)

    def _switch(self, mode: str, probing: bool) -> None:
        self.mode, self.stint, self.probing = mode, Stint(), probing
