"""Cache-aware routing, wired: a request's prompt is tokenized once with the engines' tokenizer (and the ids, signed,
go to the engines with the body, so that they skip templating and tokenizing it), its page hashes looked up in
the prefix index, and the backend chosen by `cache_aware.choose`; the choice is remembered in the
index (a prediction until the backend's events confirm it) and its uncached tokens count as that backend's
load until the request ends. Requests the router cannot tokenize (several prompts, images, before any
engine's tokenizer arrived) are routed by load alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.router.backend_pool import Backend
from splitserve.router.cache_aware import LoadTokens, choose
from splitserve.router.kv_events import KVEventsPoller
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.prompt_pages import prompt_page_hashes
from splitserve.transfer.bootstrap_grant import (
    PROMPT_DIGEST_FIELD,
    PROMPT_IDS_FIELD,
    PROMPT_SIGNATURE_FIELD,
    sign_prompt,
)

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16  # until a backend's events tell its own
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


class CacheAwareRouting:
    """The router's cache-aware choice of a unified replica or a prefill engine."""

    def __init__(self, index: PrefixIndex, poller: KVEventsPoller, max_load_tokens: int,
                 registry: CollectorRegistry) -> None:
        self.index, self.poller, self.max_load_tokens = index, poller, max_load_tokens
        self.load = LoadTokens()
        self.decision_seconds = Histogram("splitserve_router_route_decision_seconds",
                                          "Time to choose a backend by cached prefix and load",
                                          buckets=DECISION_BUCKETS, registry=registry)
        self.decisions = Counter("splitserve_router_route_decisions", "Cache-aware choices, by reason",
                                 ["reason"], registry=registry)
        self.predicted = Counter("splitserve_router_predicted_cached_tokens",
                                 "Prompt tokens predicted to come from the chosen backend's prefix cache",
                                 ["url"], registry=registry)
        self.prompt_tokens = Counter("splitserve_router_routed_prompt_tokens",
                                     "Prompt tokens of the requests routed by cached prefix", ["url"],
                                     registry=registry)
        self.reported_cached = Counter("splitserve_router_reported_cached_tokens",
                                       "Prompt tokens the chosen backend reported from its prefix cache (what the "
                                       "prediction got)", ["url"], registry=registry)

    def reported(self, url: str, cached_tokens: int | None) -> None:
        """Counts what a backend chosen here reported from its cache (None: it did not say)."""
        if cached_tokens is not None and cached_tokens >= 0:
            self.reported_cached.labels(url).inc(cached_tokens)

    def tokenize(self, path: str, body: dict[str, Any], key: str) -> TokenizedPrompt | None:
        """The request's prompt as the engines' tokenizer makes it (None where the router cannot tell: several
        prompts, images, no tokenizer yet, a body the engine will refuse), with the signed fields that hand the
        ids to the engines (`prompt_token_ids`, `tokenizer_digest`, `prompt_signature`), so that they neither
        template nor tokenize it again; none for a prompt of token ids (the body holds them) or without a key."""
        tokenizer = next(iter(self.poller.tokenizers.values()), None)
        if tokenizer is None:
            return None
        ids = tokenizer.prompt_ids(path, body)
        if not ids:
            return None
        fields: dict[str, Any] = {}
        if key and (path.endswith("/chat/completions") or _text_prompt(body.get("prompt"))):
            fields = {PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: tokenizer.prompt_digest,
                      PROMPT_SIGNATURE_FIELD: sign_prompt(key, tokenizer.prompt_digest, ids)}
        return TokenizedPrompt(ids, fields)

    def plan(self, ids: Sequence[int] | None) -> RoutePlan | None:
        """The choice of a backend for a prompt of these ids (`tokenize`); None routes by load alone."""
        return RoutePlan(self, ids) if ids else None


def _text_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str))


@dataclass(frozen=True)
class TokenizedPrompt:
    """One prompt's token ids and the body fields that carry them, signed, to the engines."""

    ids: list[int]
    fields: dict[str, Any]


class RoutePlan:
    """One request's prompt as the index sees it; `choose` picks among a pool's open backends."""

    def __init__(self, routing: CacheAwareRouting, ids: Sequence[int]) -> None:
        self.routing, self.ids = routing, ids
        self._hashes: dict[int, list[int]] = {}
        self._release: Callable[[], None] | None = None

    def hashes(self, page_size: int) -> list[int]:
        if page_size not in self._hashes:
            self._hashes[page_size] = prompt_page_hashes(list(self.ids), page_size)
        return self._hashes[page_size]

    def choose(self, candidates: list[Backend]) -> Backend:
        r = self.routing
        sizes = {r.poller.page_size.get(b.url, DEFAULT_PAGE_SIZE) for b in candidates}
        page_size = min(sizes)  # engines of one group share a page size; a mixed pool matches on the smallest
        hashes = self.hashes(page_size)
        depth = r.index.match(hashes, [b.url for b in candidates])
        choice = choose([(b.url, b.in_flight) for b in candidates], depth, page_size, len(self.ids), r.load,
                        r.max_load_tokens, r.index.store_match(hashes, depth))
        r.index.sent(choice.url, hashes)
        self._release = r.load.add(choice.url, len(self.ids) - choice.cached_tokens)
        r.decision_seconds.observe(choice.seconds)
        r.decisions.labels(choice.reason).inc()
        r.predicted.labels(choice.url).inc(choice.cached_tokens)
        r.prompt_tokens.labels(choice.url).inc(len(self.ids))
        return next(b for b in candidates if b.url == choice.url)

    def take_release(self) -> Callable[[], None]:
        """What ends this choice's load (once its lease is released)."""
        release, self._release = self._release, None
        return release or (lambda: None)
