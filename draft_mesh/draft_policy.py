"""How many drafted tokens a verifier offers a request, from how well its drafts did (pure).

Verifying costs: a step with a verify chunk runs K+1 positions per speculating request on the
eager extend path. A request whose drafts keep being rejected would run slower than plain
decoding, so each request keeps a moving average of its acceptance rate: at a high rate it is
offered all K drafts, at a middling one fewer, and below `OFF_BELOW` none for a while (doubling
each time, up to `MAX_BACKOFF_STEPS`), after which one draft probes whether the drafter agrees
again.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3  # weight of the latest verify step in the moving average
FULL_FROM = 0.5  # acceptance at which all K drafts are offered
OFF_BELOW = 0.15  # acceptance under which speculation pauses
FIRST_BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64
PROBE_RATE = 0.2  # the average a probe starts from after a pause


@dataclass
class DraftPolicy:
    """One request's acceptance average and pause."""

    acceptance: float = 1.0
    paused_steps: int = 0
    backoff: int = FIRST_BACKOFF_STEPS
    # The drafter has sent drafts for this request: it has taken it in (until then it is prefilling
    # the request, and drafts still on their way are not a few milliseconds off).
    primed: bool = False

    def observe(self, offered: int, accepted: int) -> None:
        """A verify step took `accepted` of the `offered` draft tokens."""
        if offered <= 0:
            return
        self.acceptance = (1 - SMOOTHING) * self.acceptance + SMOOTHING * accepted / offered
        if self.acceptance >= FULL_FROM:
            self.backoff = FIRST_BACKOFF_STEPS

    def draft_length(self, k: int) -> int:
        """Drafts to offer this step (0: decode on its own); call once per step."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            if self.paused_steps == 0:
                self.acceptance = PROBE_RATE
            return 0
        if self.acceptance < OFF_BELOW:
            self.paused_steps = self.backoff - 1  # this step is the pause's first
            self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
            return 0
        if self.acceptance >= FULL_FROM:
            return k
        return max(1, round(k * self.acceptance / FULL_FROM))

    def ahead(self, k: int) -> int:
        """How far past the last commit the drafter should draft for this request: for j drafts a
        step, 2j + 1, nothing while paused. A step that accepts all j commits j + 1 tokens; the
        drafter, which knew only the commit before it, then still holds the next step's j drafts
        (with 2j it held j - 1, and every step waited for the last one)."""
        if k <= 0 or self.paused_steps > 0 or self.acceptance < OFF_BELOW:
            return 0
        if self.acceptance >= FULL_FROM:
            return 2 * k + 1
        return 2 * max(1, round(k * self.acceptance / FULL_FROM)) + 1

    @property
    def worth_waiting(self) -> bool:
        """Drafts still on their way are worth waiting for (see --draft-wait-ms): the drafter has
        drafted for the request before (a request just synced, as when a probe of speculation syncs a
        whole batch, waits for none: at batch 32 on the H200 a first probe waited 37 ms for drafts
        of requests the drafter was still taking in) and its drafts do well."""
        return self.primed and self.paused_steps == 0 and self.acceptance >= FULL_FROM
