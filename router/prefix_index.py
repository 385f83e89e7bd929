"""Which backends hold which prefixes, by page hash, and how much of a prompt each holds.

Two sources per backend: the page events it publishes (`/internal/kv_events`: exact, what its prefix cache and
its host KV tier hold; a page in host memory counts as held, since loading it costs a fraction of computing it),
and the prompts the router sent it (predicted: a page the backend is computing now, or holds but has
not reported yet). A backend that publishes no events is known by its predictions alone (the approximate
mode), bounded per backend and least recently sent first out; an exact backend's predictions expire after
a few seconds, by when its events have told the truth.

Pages of the shared store tier ("store" events) are kept apart, per store (the name a backend's events give): any
backend on that store can load them, whichever reported them, so they say nothing about where a prefix is warmest;
`store_match` tells how far each backend's store reaches past what it holds, and the cache-aware choice weighs those
pages below held ones (they cross the network).

`match` walks a prompt's page hashes once for all backends (a bitmask per hash), so its cost grows with the
prompt's pages, not with the backends or their pages.
"""

from __future__ import annotations

import collections
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

STORE = "store"  # the shared store tier's events (engine/page_events.py)


class _Holdings:
    """One backend's pages: reported per tier (exact) and predicted (hash -> when the prediction lapses)."""

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.tiers: dict[str, set[int]] = {}  # reported: tier ("device", "host", "store") -> its hashes
        self.store: str | None = None  # the shared store it names
        self.predicted: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.publishes = False  # it answered /internal/kv_events at least once
        self.epoch: str | None = None
        self.seq = 0

    def reported(self, h: int) -> bool:
        """Held in device or host memory (store pages are the store's, not the backend's)."""
        return any(h in hashes for tier, hashes in self.tiers.items() if tier != STORE)

    def all_reported(self) -> set[int]:
        return set().union(*(hashes for tier, hashes in self.tiers.items() if tier != STORE))


class PrefixIndex:
    """Page hashes per backend, and the longest cached prefix of a prompt on each."""

    def __init__(self, approximate_pages: int = 1 << 17, prediction_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.approximate_pages = approximate_pages
        self.prediction_ttl_s = prediction_ttl_s
        self.clock = clock
        self._backends: dict[str, _Holdings] = {}
        self._owners: dict[int, int] = {}  # hash -> bitmask of the backends holding it
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._stores: dict[str, Counter[int]] = {}  # store -> hash -> how many backends reported it there

    # ---- membership --------------------------------------------------------------------------

    def _holdings(self, url: str) -> _Holdings:
        held = self._backends.get(url)
        if held is None:
            bit = self._free_bits.pop() if self._free_bits else self._next_bit
            self._next_bit = max(self._next_bit, bit + 1)
            held = self._backends[url] = _Holdings(bit)
        return held

    def forget(self, url: str) -> None:
        """Drops a backend that left the pool, and every page it held."""
        held = self._backends.pop(url, None)
        if held is None:
            return
        for h in held.all_reported() | set(held.predicted):
            self._clear(h, held.bit)
        self._store_pages(held, held.tiers.get(STORE, set()), added=False)
        self._free_bits.append(held.bit)

    def cursor(self, url: str) -> tuple[str | None, int]:
        """(epoch, seq) of the last events applied for `url`: what to ask for next."""
        held = self._holdings(url)
        return held.epoch, held.seq

    def publishes(self, url: str) -> bool:
        held = self._backends.get(url)
        return held is not None and held.publishes

    def tier_pages(self, url: str) -> dict[str, int]:
        """Pages per tier a backend reported holding."""
        held = self._backends.get(url)
        return {} if held is None else {tier: len(hashes) for tier, hashes in held.tiers.items()}

    def pages(self, url: str) -> int:
        held = self._backends.get(url)
        return 0 if held is None else len(held.all_reported() | set(held.predicted))

    # ---- updates -----------------------------------------------------------------------------

    def _set(self, h: int, bit: int) -> None:
        self._owners[h] = self._owners.get(h, 0) | (1 << bit)

    def _store_pages(self, held: _Holdings, hashes: Iterable[int], added: bool) -> None:
        """Counts (or uncounts) a backend's reports of pages in its store."""
        if held.store is None:
            return
        pages = self._stores.setdefault(held.store, Counter())
        for h in hashes:
            pages[h] += 1 if added else -1
            if pages[h] <= 0:
                del pages[h]
        if not pages:
            del self._stores[held.store]

    def _clear(self, h: int, bit: int) -> None:
        mask = self._owners.get(h, 0) & ~(1 << bit)
        if mask:
            self._owners[h] = mask
        else:
            self._owners.pop(h, None)

    def apply_events(self, url: str, answer: dict[str, Any]) -> None:
        """Applies one `/internal/kv_events` answer (a reset replaces what the backend reported before)."""
        held = self._holdings(url)
        held.publishes = True
        if answer["reset"]:  # a store is named for an epoch: a new one starts with a reset
            for h in held.all_reported():
                if h not in held.predicted:
                    self._clear(h, held.bit)
            self._store_pages(held, held.tiers.get(STORE, set()), added=False)
            held.tiers = {}
            held.store = answer.get("store")
        for op, tier, hashes in answer["events"]:
            reported = held.tiers.setdefault(tier, set())
            if tier == STORE:
                new = set(hashes) - reported if op == "stored" else reported & set(hashes)
                (reported.update if op == "stored" else reported.difference_update)(new)
                self._store_pages(held, new, added=op == "stored")
            elif op == "stored":
                reported.update(hashes)
                for h in hashes:
                    self._set(h, held.bit)
            else:
                reported.difference_update(hashes)
                for h in hashes:
                    if h not in held.predicted and not held.reported(h):
                        self._clear(h, held.bit)
        held.epoch, held.seq = answer["epoch"], answer["seq"]

    def sent(self, url: str, hashes: Sequence[int]) -> None:
        """Notes that a prompt with these page hashes went to `url`: it will hold them."""
        held = self._holdings(url)
        lapses = self.clock() + self.prediction_ttl_s
        for h in hashes:
            held.predicted[h] = lapses
            held.predicted.move_to_end(h)
            self._set(h, held.bit)
        self._expire(held)

    def _expire(self, held: _Holdings) -> None:
        """Predictions past their time (exact backends) or past the approximate bound (the oldest first)."""
        now = self.clock()
        while held.predicted:
            h, lapses = next(iter(held.predicted.items()))
            over = len(held.predicted) > self.approximate_pages
            if not over and (not held.publishes or lapses > now):
                break
            del held.predicted[h]
            if not held.reported(h):
                self._clear(h, held.bit)

    # ---- lookups -----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """url -> how many of the prompt's first pages that backend holds (0 for one unknown here)."""
        depth = {url: 0 for url in urls}
        bits = {}
        for url in depth:
            held = self._backends.get(url)
            if held is not None:
                self._expire(held)
                bits[held.bit] = url
        alive = sum(1 << b for b in bits)
        for i, h in enumerate(hashes):
            if not alive:
                break
            still = self._owners.get(h, 0) & alive
            dropped = alive & ~still
            while dropped:
                low = dropped & -dropped
                depth[bits[low.bit_length() - 1]] = i
                dropped ^= low
            alive = still
        while alive:
            low = alive & -alive
            depth[bits[low.bit_length() - 1]] = len(hashes)
            alive ^= low
        return depth

    def store_match(self, hashes: Sequence[int], depth: dict[str, int]) -> dict[str, int]:
        """url -> how many of the prompt's first pages a backend reaches in its own memory or its shared store,
        given `depth` (`match`: what it holds); its depth for a backend without a store. The engine loads the
        held pages first and continues in the store, so the run continues through pages of either."""
        reach = dict(depth)
        for url, held_pages in depth.items():
            held = self._backends.get(url)
            pages = self._stores.get(held.store) if held is not None and held.store is not None else None
            if pages is None:
                continue
            i = held_pages
            while i < len(hashes) and (hashes[i] in pages or (self._owners.get(hashes[i], 0) >> held.bit) & 1):
                i += 1
            reach[url] = i
        return reach
