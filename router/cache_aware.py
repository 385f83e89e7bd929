"""Cache-aware choice of a backend: where the longest cached prefix of the prompt is, balanced against load.

Each backend's load is counted in tokens: the prompt tokens it has to compute for the requests the router
has in flight there (their uncached part). The rule:
- the backend holding the most of the prompt gets it, while its load stays under `max_load_tokens`
  (sticky: a prefix stays where it is cached, and each backend keeps its own prefixes warm);
- otherwise (no backend holds any of it, or the one that does is saturated) the backend where the request
  adds least to the work queued: min(uncached tokens + load tokens), fewest requests in flight on a tie.
A page the backend reaches only in its shared store counts as `STORE_HIT_WEIGHT` of a held page in both rules: it
saves the compute but crosses the network, and every backend on that store reaches it alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

STORE_HIT_WEIGHT = 0.5  # a store page's worth against one held in device or host memory


@dataclass(frozen=True)
class Choice:
    """A decision: the backend, and what it predicts."""

    url: str
    cached_tokens: int  # the prompt tokens predicted to come from that backend's cache
    best_cached_tokens: int  # the most any candidate held
    reason: str  # "cache" (sticky on the longest prefix), "load" (the least added work)
    seconds: float  # how long deciding took


class LoadTokens:
    """Uncached prompt tokens in flight per backend: added when a request is sent, removed when it ends."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def add(self, url: str, tokens: int) -> Callable[[], None]:
        self.tokens[url] = self.tokens.get(url, 0) + tokens
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.tokens[url] -= tokens
        return release

    def __getitem__(self, url: str) -> int:
        return self.tokens.get(url, 0)


def choose(candidates: Sequence[tuple[str, int]], cached_pages: dict[str, int], page_size: int,
           prompt_tokens: int, load: LoadTokens, max_load_tokens: int,
           store_pages: dict[str, int] | None = None) -> Choice:
    """`candidates`: (url, requests in flight) of the backends that may take the request, in round-robin order;
    `cached_pages`: the prompt's leading pages each holds; `store_pages`: how far each reaches counting its
    shared store (`PrefixIndex.store_match`; none: no store)."""
    start = time.perf_counter()
    cap = max(0, prompt_tokens - 1)
    held = {url: min(cached_pages.get(url, 0) * page_size, cap) for url, _ in candidates}
    reach = {url: max(held[url], min((store_pages or {}).get(url, 0) * page_size, cap)) for url, _ in candidates}
    worth = {url: held[url] + STORE_HIT_WEIGHT * (reach[url] - held[url]) for url, _ in candidates}
    in_flight = dict(candidates)
    best = max(worth.values(), default=0)
    most = max(reach.values(), default=0)
    if best > 0:
        holders = [u for u, _ in candidates if worth[u] == best and load[u] < max_load_tokens]
        if holders:
            url = min(holders, key=lambda u: (load[u], in_flight[u]))
            return Choice(url, reach[url], most, "cache", time.perf_counter() - start)
    url = min((u for u, _ in candidates), key=lambda u: (prompt_tokens - worth[u] + load[u], in_flight[u]))
    return Choice(url, reach[url], most, "load", time.perf_counter() - start)
