"""Whether a step should verify drafts at all, from what steps measurably cost (pure).

Each request's DraftPolicy (draft_mesh/draft_policy.py) says how many drafts it may take from how
often its drafts were accepted. Whether verifying pays depends on the whole step: a verify step of
B requests with R rows each costs more than a plain decode step of B rows (much more at large B,
where the projections stop being a stream over the weights), and it pays only if the tokens it
is expected to emit come faster than plain decoding's B per step. The gate keeps the wall time of
recent steps of each kind (plain: per batch; verify: per batch and rows per request) and lets a
step verify when

    expected tokens / time of a verify step  >=  B / time of a plain step.

A kind not measured yet is tried. While the gate keeps verifying off, every `PROBE_EVERY`-th step
still verifies, so that a drafter that became better (or cheaper) is noticed; while verifying is
on, every `REFRESH_EVERY`-th step decodes plainly, so that the plain time stays current.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.3  # weight of the latest step in each time average
PROBE_EVERY = 16
REFRESH_EVERY = 64


@dataclass
class SpeculationGate:
    """Step-time averages by kind of step, and the decision for the next step."""

    plain_s: dict[int, float] = field(default_factory=dict)  # by batch
    verify_s: dict[tuple[int, int], float] = field(default_factory=dict)  # by (batch, rows per request)
    steps_since_verify: int = 0
    steps_since_plain: int = 0

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A step of `batch` requests took `seconds`; rows > 1: it verified drafts (R rows each)."""
        if batch <= 0 or seconds <= 0:
            return
        table, key = (self.verify_s, (batch, rows)) if rows > 1 else (self.plain_s, batch)
        old = table.get(key)  # type: ignore[call-overload]
        table[key] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds  # type: ignore[index]
        if rows > 1:
            self.steps_since_verify, self.steps_since_plain = 0, self.steps_since_plain + 1
        else:
            self.steps_since_verify, self.steps_since_plain = self.steps_since_verify + 1, 0

    def verify_pays(self, batch: int, rows: int, expected_tokens: float) -> bool:
        """Whether the next step, `batch` requests of which drafts would make R = `rows` rows each and
        emit `expected_tokens` in all, should verify them."""
        plain, verify = self.plain_s.get(batch), self.verify_s.get((batch, rows))
        if plain is None:  # plain decoding is what the gate compares with: measure it first
            return False
        if verify is None or self.steps_since_verify + 1 >= PROBE_EVERY:
            return True
        if self.steps_since_plain + 1 >= REFRESH_EVERY:
            return False
        return expected_tokens / verify >= batch / plain

    def likely_off(self, batch: int, rows: int, expected_tokens: float) -> bool:
        """Whether verifying is measured not to pay for this batch (drafters may then skip drafting
        far ahead, except shortly before a probe)."""
        plain, verify = self.plain_s.get(batch), self.verify_s.get((batch, rows))
        if plain is None or verify is None or self.steps_since_verify + 2 >= PROBE_EVERY:
            return False
        return expected_tokens / verify < batch / plain
