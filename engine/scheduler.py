"""Which requests run this step and how many of their tokens: returns a plan, runs nothing.

Continuous batching with chunked prefill under one token budget per step (the chunked prefill
size). While the prompts to compute would fill a whole step (a burst of arrivals, a long prompt),
the step is prompt chunks only and the running decodes wait, as SGLang's default schedule does:
a burst's last prompt, whose decode ends the burst, starts decoding sooner, every prompt's first
token comes sooner, and the decodes that would have run beside the prompts shorten nothing (the
burst still takes its last request's decode steps after its prefill). Otherwise (and always under
`decode_first`) decodes and prompt chunks share the step's budget as vLLM shares it, in the order
that keeps inter-token latency steady:
1. every running request that is decoding gets its one token (preempting the newest running
   request when pages run out), or, when a behaviour offered draft tokens for it
   (`Request.draft_tokens`), one verify chunk over its last token and the draft (the draft is
   dropped rather than preempt anyone for it); their tokens count against the budget;
2. requests part-way through their prompt continue, within what is left of the budget (at
   least an eighth of it, so that a large decode batch cannot stall admission for good);
3. waiting requests are admitted in arrival order while a slot, the budget and the pages for
   their whole prompt are there; one whose prompt shares full pages with a prompt still being
   computed (the n samples of one request, or the same prompt sent twice) waits for those pages
   to reach the prefix cache instead of computing them again, and, when the KV cache copies
   partial pages, for the page with its last tokens too (then only its last token runs).
   A request whose matched pages are still being loaded from the host tier (engine/host_kv.py, on
   CUDA) is admitted but runs nothing until the load is done; the others run meanwhile.
A step then costs about the same whatever its mix: a decode's wait behind a prompt (its
inter-token latency) stays bounded by the budget, and the GPU gets full-size matmuls.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """Run `length` tokens of `request` starting at its `kv_len`; sample after if `sample`.

    A verify chunk (`draft` not empty) runs the last known token followed by the draft tokens
    (`length == 1 + len(draft)`), and the sampler verifies the draft against the logits at
    every one of those positions.
    """

    request: Request
    start: int
    length: int
    sample: bool
    draft: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """One forward pass worth of work."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cache_full: list[Request] = field(default_factory=list)  # cannot grow even alone: to be ended

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler works within."""

    max_running_requests: int
    chunked_prefill_size: int  # tokens per step, decodes included; <= 0 means whole prompts
    context_length: int
    decode_first: bool = False  # decodes run every step, even while prompts would fill it


def prefill_budget(step_budget: int, decode_tokens: int) -> int:
    """Prompt tokens a step may take beside `decode_tokens` decode (and verify) tokens: the rest of
    the step's budget, but never less than an eighth of it."""
    return max(step_budget - decode_tokens, max(1, step_budget // 8))


class Scheduler:
    """Owns the waiting queue and the running set; plans steps over the shared KV cache."""

    def __init__(self, config: SchedulerConfig, kv: KVCache) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Puts a request that already holds a slot and pages (e.g. its KV arrived) into the batch."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self) -> StepPlan:
        step_budget = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 1 << 62
        prefilling = self._prefilling()
        if not self.config.decode_first and self._prompt_tokens_to_run(prefilling, step_budget) >= step_budget:
            plan = StepPlan()
            self._schedule_prompts(plan, step_budget, prefilling)
            if plan:
                return plan  # else no prompt could start (pages): the decodes run as usual
            prefilling = self._prefilling()  # it may have admitted requests that could not run yet
        plan = StepPlan()
        self._schedule_decodes(plan)
        # Prompts in what the decodes left of the step's budget.
        self._schedule_prompts(plan, prefill_budget(step_budget, plan.num_tokens), prefilling)
        return plan

    def _prefilling(self) -> list[Request]:
        """The running requests part-way through their prompt (or recomputing it), in batch order."""
        running = RequestStatus.RUNNING
        return [r for r in self.running if r.status is running  # `in_prefill`, without two property calls a row
                and (r.kv_len < len(r.prompt_ids) or len(r.prompt_ids) + len(r.output_ids) - r.kv_len > 1)]

    def _prompt_tokens_to_run(self, prefilling: list[Request], enough: int) -> int:
        """Prompt tokens the running prompts still have and the waiting requests that may start
        bring (their whole prompts: prefix cache hits are known only once admitted), counted up to
        `enough`."""
        tokens = sum(req.pending_len for req in prefilling)
        slots = min(self.kv.free_slots, self.config.max_running_requests - len(self.running))
        for req in itertools.islice(self.waiting, max(0, slots)):
            if tokens >= enough:
                break
            tokens += req.total_len
        return tokens

    def _schedule_decodes(self, plan: StepPlan) -> None:
        """Every running request that is decoding gets its one token (or its verify chunk); preempts
        the newest running request when pages run out. One pass, each request's fields read once
        (a few hundred rows every step)."""
        context, page = self.config.context_length, self.kv.page_size
        running = RequestStatus.RUNNING
        loading = self.kv.loading
        for req in list(self.running):
            kv_len, prompt_len = req.kv_len, len(req.prompt_ids)
            pending = prompt_len + len(req.output_ids) - kv_len
            if kv_len < prompt_len or pending > 1:
                continue  # in prefill: the prompt pass schedules it
            if req.status is not running:
                continue  # preempted below while making room for an older request
            if kv_len >= context:
                continue  # at the context limit: the step in flight (overlap) ends it
            if pending == 0 and len(req.output_ids) + 1 >= req.params.max_new_tokens:
                continue  # its last token is in flight (overlap): nothing more to run for it
            if loading and self.kv.waits_for_load(req):
                continue  # (a decode engine's request) its prefix pages are still coming from the host tier
            draft = self._take_draft(req) if req.draft_tokens else []
            length = 1 + len(draft)
            if kv_len + length <= len(req.pages) * page:  # its pages hold it already: nothing to grow
                plan.chunks.append(ScheduledChunk(req, kv_len, length, True, draft))
                continue
            while not self.kv.grow(req, kv_len + length):
                if draft:
                    draft = []  # no pages for the draft: decode one token as usual
                    length = 1
                    continue
                victim = self._newest_running(exclude=req)
                if victim is None:
                    break
                self._preempt(victim, plan)
            else:
                plan.chunks.append(ScheduledChunk(req, kv_len, length, True, draft))
                continue
            # Alone and still no page. Pages that others hold (a decode's reservations for KV still arriving, a
            # prefill's rooms, loads from the host tier) come back: it waits a step for them. Only a request that
            # holds every page in use ends here (length): the whole cache is its own.
            if self.kv.usage().used_by_requests > len(req.pages):
                continue
            logger.warning("request %s fills the KV cache (%d tokens); ending it", req.request_id, req.kv_len)
            self.running.remove(req)
            plan.cache_full.append(req)

    def _schedule_prompts(self, plan: StepPlan, budget: int, prefilling: list[Request]) -> None:
        """Prompts in progress continue, then waiting requests are admitted, within `budget` tokens."""
        for req in prefilling:
            if budget <= 0:
                break
            if req.status is RequestStatus.RUNNING:  # not preempted by the decodes
                budget -= self._schedule_prefill(req, budget, plan)

        # Admit waiting requests.
        held: list[Request] = []  # waiting for a running request's prompt pages
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self._awaits_shared_prefix(req):
                held.append(self.waiting.popleft())
                continue
            if not self.kv.free_slots:
                break
            # Keep at least one token to run, so the step yields logits to sample from.
            self.kv.admit(req, max_prefix_tokens=req.total_len - 1, copy_partial=True)
            need = self.kv.pages_for(req.total_len) - len(req.pages)
            if need > self.kv.available_pages():
                self.kv.release(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._schedule_prefill(req, budget, plan)
        self.waiting.extendleft(reversed(held))

    def _awaits_shared_prefix(self, req: Request) -> bool:
        """True while a running request computes prompt pages `req` could take from the prefix
        cache once they are there (more than it has published so far), or, when the KV cache
        copies partial pages, the page that holds `req`'s last token (`_ends_in_the_prompt_of`)."""
        page = self.kv.page_size
        usable = (req.total_len - 1) // page  # admission keeps one token to run
        copies = self.kv.copies_partial_pages
        if (usable == 0 and not copies) or not self.kv.prefix_cache.enabled:
            return False
        key = None
        for other in self.running:
            if other.status is not RequestStatus.RUNNING or not (other.in_prefill or other.publishing):
                continue
            if copies and self._ends_in_the_prompt_of(req, other) and other.published_len < req.total_len:
                key = key if key is not None else req.cache_ids
                if key[:req.total_len] == other.cache_ids[:req.total_len]:
                    return True  # the same tokens: the page with our last ones is theirs
            published = other.published_len // page
            pages = min(usable, len(other.prompt_ids) // page)
            if pages <= published:
                continue
            key = key if key is not None else req.cache_ids
            theirs = other.cache_ids
            if key[: (published + 1) * page] == theirs[: (published + 1) * page]:
                return True  # at least the next page they publish is one of ours
        return False

    def _ends_in_the_prompt_of(self, req: Request, other: Request) -> bool:
        """Whether `req`'s last page could be a copy of a page of `other`'s prompt (if their tokens
        agree): `req` ends where that prompt does (its partial last page, listed once computed) or
        on a page boundary inside it (a full page, cached once computed)."""
        total, theirs = req.total_len, len(other.prompt_ids)
        return 2 <= total <= theirs and (total == theirs or total % self.kv.page_size == 0)

    def _take_draft(self, req: Request) -> list[int]:
        """The request's offered draft, cut to what it may still emit (context and max_tokens keep
        room for the token verification adds); empty unless its last token is known on the host."""
        draft, req.draft_tokens = req.draft_tokens, []
        if not draft or req.pending_len != 1:
            return []
        room = min(self.config.context_length - req.kv_len - 1, req.params.max_new_tokens - len(req.output_ids) - 1)
        return draft[:max(room, 0)]

    def _schedule_prefill(self, req: Request, budget: int, plan: StepPlan) -> int:
        if self.kv.loading and self.kv.waits_for_load(req):
            return 0  # its prefix pages are still coming from the host tier
        length = min(req.pending_len, budget)
        if not self.kv.grow(req, req.kv_len + length):
            return 0
        sample = length == req.pending_len
        plan.chunks.append(ScheduledChunk(req, req.kv_len, length, sample=sample))
        return length

    def _newest_running(self, exclude: Request) -> Request | None:
        candidates = [r for r in self.running if r is not exclude]
        return max(candidates, key=lambda r: r.arrival_time, default=None)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Gives back a running request's pages (its KV goes to the prefix cache) and requeues it."""
        logger.info("preempting request %s (%d tokens) to free KV pages", req.request_id, req.total_len)
        self.running.remove(req)
        plan.chunks = [c for c in plan.chunks if c.request is not req]
        self.kv.release(req)
        req.tenure += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        plan.preempted.append(req)
