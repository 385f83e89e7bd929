"""How much decoding time speculation may still lose against plain decoding at one batch bucket (pure).

The speculation gate (draft_mesh/speculation_gate.py) keeps the mode whose stints measured faster,
but a stint's rate leaves out its first steps (the drafter taking the requests in, the pipeline
refilling), and every probe of a mode that loses costs its steps whatever the rates say. The
budget bounds what all of that costs, by measurement: each decoding step earns MARGIN of its
seconds, and each speculating step is charged what it lost against plain decoding's measured rate
at its bucket (its seconds minus the seconds plain decoding takes for its tokens; a step that
gained pays back). Speculation runs only while the headroom lasts: a stint ends before a step like
its last one would overdraw it, and a new one starts only with PROBE_FROM of the cap saved. A
bucket starts with the cap (its first probe may cost that much) and saves no more than CAP_STEPS
plain steps, so a stint that turns bad after winning long ends within that loss too. Over any
stretch of decoding at one bucket, speculating then costs at most MARGIN of its time plus the cap
(and the one step that overdrew it) against plain decoding. Before a stint's first verify step (its
drafter taking the requests in) a step's loss does not predict the next ones: only an overdrawn
headroom ends the stint then.

A stint that verified no drafts at all (its drafter still taking the requests in, or not drafting)
is no evidence about speculating: the gate ends it (draft_mesh/speculation_gate.py) and gives the
bucket back the headroom it started with (`refund`); what such stints cost is bounded by the gate's
retry backoff instead (each costs at most the headroom it started with and one step). And a debt is
not held against speculating for good: once RECOVER_S has passed since the last charged step, a
stint may start on it (the headroom is raised to PROBE_FROM of the cap), and the next debt waits
twice as long (up to MAX_RECOVER_S; back to RECOVER_S once the bucket has saved its whole cap again).
A drafter that keeps losing then costs at most half the cap and one step per such wait on top of the
bound above; a loss that was a warm-up artefact (a drafter's first, slow steps) keeps the budget from
letting speculating start for RECOVER_S at most.

The gate acts on it unless --no-speculation-budget (SpecConfig; on by default). Measured on the
H200, spec bench, 96-token runs: with 2 steps of cap and every step's loss predicted from the last,
stints were cut at their first steps (batch 1 K=4/8 1.01/0.98x of plain); with the cap of 3 and the
first steps unpredicted, as here, batch 1 kept 1.48/1.90/2.41x at K=2/4/8 and the first probe at
batch 32 (K=2) cost 0.96x of plain (0.92x without the budget), most of it the drafter prefilling the
32 synced requests on the shared device. Counting the tokens of requests that finish in a step (a
run's last step was charged as all loss, which drained batch 1's headroom: K=4/8 1.02/1.05x) and
letting a stint the batch carries down into a bucket without a plain rate go on, every exact-drafter
cell was at 1.02x of plain or better (batch 1 1.49/1.82/2.24x, batch 32 K=2 1.02x where the gate
alone lost 0.94x). A first probe that got no drafts (the drafter joined about a second before the
load) was then taken as a loss and its charges kept speculating off for the rest of the run (1.00x in
every cell, 0 drafts verified): hence the refund and the recovery above.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

MARGIN = 0.01  # of decoding time, what speculating may lose against plain decoding in the long run
CAP_STEPS = 3.0  # headroom saved at most, in plain steps of the bucket (also a bucket's first probe's)
PROBE_FROM = 0.5  # of the cap, the headroom a speculating stint needs to start
RECOVER_S = 1.0  # seconds after its last charged step a debt no longer keeps speculating from starting
MAX_RECOVER_S = 64.0  # the most that wait grows to (it doubles at each debt forgiven)


@dataclass
class LossBudget:
    """One bucket's headroom (seconds speculating may still lose) and what speculating saved so far."""

    margin: float = MARGIN
    cap_steps: float = CAP_STEPS
    headroom_s: float | None = None  # None until plain decoding's step time here is measured
    cap_s: float = 0.0
    saved_s: float = 0.0  # net seconds speculating saved against plain decoding (negative: lost)
    last_loss_s: float = 0.0  # what the latest speculating step lost (negative: gained)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    recover_s: float = RECOVER_S  # how old a debt must be before a stint may start on it
    charged_at: float | None = None  # the clock at the latest charged speculating step
    opened_s: float | None = None  # the headroom the current stint started with
    forgiven: int = 0  # debts forgiven so far

    def plain_step(self, seconds: float) -> None:
        """Plain decoding's step time here, from the gate's latest plain stint."""
        self.cap_s = self.cap_steps * seconds
        self.headroom_s = self.cap_s if self.headroom_s is None else min(self.headroom_s, self.cap_s)

    def step(self, seconds: float, tokens: int = 0, plain_rate: float | None = None) -> None:
        """A decoding step took `seconds`; with `plain_rate` (tokens/s) it speculated and emitted
        `tokens`, and is charged its loss against that rate."""
        if self.headroom_s is None:
            return
        earned = self.margin * seconds
        if plain_rate:
            self.last_loss_s = seconds - tokens / plain_rate
            self.saved_s -= self.last_loss_s
            earned -= self.last_loss_s
            self.charged_at = self.clock()
        self.headroom_s = min(self.headroom_s + earned, self.cap_s)
        if self.headroom_s >= self.cap_s:  # the bucket saved its whole cap: a later debt waits RECOVER_S again
            self.recover_s = RECOVER_S

    def can_continue(self, predict: bool = True) -> bool:
        """Another step like the last speculating one stays within the headroom (`predict` False:
        the headroom is not overdrawn yet)."""
        expected = max(self.last_loss_s, 0.0) if predict else 0.0
        return self.headroom_s is not None and self.headroom_s - expected >= 0.0

    def can_start(self) -> bool:
        """Enough headroom to start speculating (plain decoding measured here first), or a debt old
        enough to be forgiven (`started` forgives it)."""
        if self.headroom_s is None or self.cap_s <= 0:
            return False
        return self.headroom_s >= PROBE_FROM * self.cap_s or self.debt_forgivable

    @property
    def debt_forgivable(self) -> bool:
        """The headroom is short, but its latest charge is RECOVER_S (doubled per debt forgiven) old."""
        return self.charged_at is not None and self.clock() - self.charged_at >= self.recover_s

    def started(self, forgive: bool = True) -> None:
        """A speculating stint starts (`forgive`: on a debt old enough, which is forgiven: the headroom
        becomes PROBE_FROM of the cap, and the next debt waits twice as long)."""
        self.last_loss_s = 0.0
        short = self.headroom_s is not None and self.headroom_s < PROBE_FROM * self.cap_s
        if forgive and short and self.debt_forgivable:
            self.headroom_s = PROBE_FROM * self.cap_s
            self.recover_s = min(2 * self.recover_s, MAX_RECOVER_S)
            self.forgiven += 1
        self.opened_s = self.headroom_s

    def refund(self) -> None:
        """The stint verified no drafts: no evidence, and its charges do not keep the next one from starting
        (the headroom it started with comes back; saved_s still counts what it cost)."""
        if self.headroom_s is not None and self.opened_s is not None:
            self.headroom_s = max(self.headroom_s, min(self.opened_s, self.cap_s))
