"""Which backends hold which prefixes, by page hash, and how much of a prompt each holds.

Two sources per backend: the page events it publishes (`/internal/kv_events`: exact, what its prefix cache and
its host KV tier hold; a page in host memory counts as held, since loading it costs a fraction of computing it),
and the prompts the router sent it (predicted: a page the backend is computing now, or holds but has
not reported yet). A backend that publishes no events is known by its predictions alone (the approximate
mode), bounded per backend and least recently sent first out; an exact backend's predictions expire after
a few seconds, by when its events have told the truth.

`match` walks a prompt's page hashes once for all backends (a bitmask per hash), so its cost grows with the
prompt's pages, not with the backends or their pages.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class _Holdings:
    """One backend's pages: reported per tier (exact) and predicted (hash -> when the prediction lapses)."""

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.tiers: dict[str, set[int]] = {}  # reported: tier ("device", "host") -> its hashes
        self.predicted: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.publishes = False  # it answered /internal/kv_events at least once
        self.epoch: str | None = None
        self.seq = 0

    def reported(self, h: int) -> bool:
        return any(h in hashes for hashes in self.tiers.values())

    def all_reported(self) -> set[int]:
        return set().union(*self.tiers.values())


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
        if answer["reset"]:
            for h in held.all_reported():
                if h not in held.predicted:
                    self._clear(h, held.bit)
            held.tiers = {}
        for op, tier, hashes in answer["events"]:
            reported = held.tiers.setdefault(tier, set())
            if op == "stored":
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
