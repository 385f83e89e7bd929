"""The encode engine's embedding cache: image hash -> a slot of the sender's registered pool.

Least recently used slots are reused first, never one a transfer is still reading (pinned). A hit
ships the cached rows without running the vision tower again.
"""

from __future__ import annotations

from collections import OrderedDict


class EmbeddingCache:
    """LRU over `num_slots` slots with pin counts."""

    def __init__(self, num_slots: int) -> None:
        self._by_digest: OrderedDict[str, int] = OrderedDict()
        self._digest_of: dict[int, str] = {}
        self._pins: dict[int, int] = {}
        self._unused = list(range(num_slots - 1, -1, -1))

    def lookup(self, digest: str) -> int | None:
        """The slot holding `digest`'s rows, pinned (None on a miss)."""
        slot = self._by_digest.get(digest)
        if slot is not None:
            self._by_digest.move_to_end(digest)
            self.pin(slot)
        return slot

    def reserve(self) -> int | None:
        """A pinned slot to fill (an unused one, else the least recently used unpinned one)."""
        if self._unused:
            slot = self._unused.pop()
        else:
            victim = next((d for d, s in self._by_digest.items() if not self._pins.get(s)), None)
            if victim is None:
                return None
            slot = self._by_digest.pop(victim)
            del self._digest_of[slot]
        self.pin(slot)
        return slot

    def insert(self, digest: str, slot: int) -> None:
        """`slot` now holds `digest`'s rows."""
        self._by_digest[digest] = slot
        self._digest_of[slot] = digest

    def discard(self, slot: int) -> None:
        """A reserved slot that was never filled goes back."""
        if slot not in self._digest_of:
            self._unused.append(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.get(slot, 0) - 1
        if left <= 0:
            self._pins.pop(slot, None)
        else:
            self._pins[slot] = left

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._by_digest)
