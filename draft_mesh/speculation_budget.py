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

The gate acts on it unless --no-speculation-budget (SpecConfig; on by default since cc1e06d).
Measured on the H200, spec bench, 96-token runs (NOTES-issue13.md, seventh session): with 2 steps of
cap and every step's loss predicted from the last, stints were cut at their first steps (batch 1
K=4/8 1.01/0.98x of plain); with the cap of 3 and the first steps unpredicted, as here, batch 1 kept
1.48/1.90/2.41x at K=2/4/8 and the first probe at batch 32 (K=2) cost 0.96x of plain (0.92x without
the budget), most of it the drafter prefilling the 32 synced requests on the shared device. With the
drafter's prefix cache as well, that probe cost nothing (0.99x), but batch 1 K=4/8 fell to
1.02/1.05x: the verifier charged each run's last step as all loss (the tokens of requests finishing
in it were not counted), which drained batch 1's headroom below what a probe needs, and a stint the
batch carried into a bucket without a plain rate stopped there. Both fixed (f6c88fc), the lead's run
on main 68549f3 had every exact-drafter cell at 1.02x of plain or better (batch 1 1.49/1.82/2.24x,
batch 32 K=2 1.02x where the gate alone lost 0.94x); the perturbed drafter under the budget was not
reached there.
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.01  # of decoding time, what speculating may lose against plain decoding in the long run
CAP_STEPS = 3.0  # headroom saved at most, in plain steps of the bucket (also a bucket's first probe's)
PROBE_FROM = 0.5  # of the cap, the headroom a speculating stint needs to start


@dataclass
class LossBudget:
    """One bucket's headroom (seconds speculating may still lose) and what speculating saved so far."""

    margin: float = MARGIN
    cap_steps: float = CAP_STEPS
    headroom_s: float | None = None  # None until plain decoding's step time here is measured
    cap_s: float = 0.0
    saved_s: float = 0.0  # net seconds speculating saved against plain decoding (negative: lost)
    last_loss_s: float = 0.0  # what the latest speculating step lost (negative: gained)

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
        self.headroom_s = min(self.headroom_s + earned, self.cap_s)

    def can_continue(self, predict: bool = True) -> bool:
        """Another step like the last speculating one stays within the headroom (`predict` False:
        the headroom is not overdrawn yet)."""
        expected = max(self.last_loss_s, 0.0) if predict else 0.0
        return self.headroom_s is not None and self.headroom_s - expected >= 0.0

    @property
    def can_start(self) -> bool:
        """Enough headroom to start speculating (plain decoding measured here first)."""
        return self.headroom_s is not None and self.cap_s > 0 and self.headroom_s >= PROBE_FROM * self.cap_s

    def started(self) -> None:
        self.last_loss_s = 0.0
