"""A pool of fixed-size embedding slots in one tensor, registered with Mooncake once.

A slot holds up to ``max_rows`` rows of ``hidden`` values. Prefill leases one per image item and
gives it back after the rows are copied out; a slot whose item failed is *held back* for
``hold_s`` first, because a write the encoder already started may still land in it. The encoder
uses a pool of its own as the source of its writes and as its LRU cache of embeddings.
"""

from __future__ import annotations

import time

import torch


class EmbeddingSlots:
    """``num_slots`` x ``max_rows`` x ``hidden`` rows; lease / free / hold back by slot index."""

    def __init__(self, num_slots: int, max_rows: int, hidden: int, dtype: torch.dtype, hold_s: float,
                 device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(num_slots, max_rows, hidden, dtype=dtype, device=device)
        self.max_rows, self.hidden, self.dtype = max_rows, hidden, dtype
        self.hold_s = hold_s
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: dict[int, float] = {}  # slot -> when it may be reused

    @property
    def ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def slot_bytes(self) -> int:
        return self.max_rows * self.hidden * self.buffer.element_size()

    def slot_ptr(self, slot: int) -> int:
        return self.ptr + slot * self.slot_bytes

    def rows(self, slot: int, n: int) -> torch.Tensor:
        return self.buffer[slot, :n]

    def lease(self, now: float | None = None) -> int | None:
        self._reclaim(time.monotonic() if now is None else now)
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def hold_back(self, slot: int, now: float | None = None) -> None:
        """Frees ``slot`` only after ``hold_s``: a late write may still be on its way."""
        self._held[slot] = (time.monotonic() if now is None else now) + self.hold_s

    def _reclaim(self, now: float) -> None:
        for slot, until in list(self._held.items()):
            if until <= now:
                del self._held[slot]
                self._free.append(slot)

    def counts(self, now: float | None = None) -> dict[str, int]:
        self._reclaim(time.monotonic() if now is None else now)
        return {"free": len(self._free), "held": len(self._held),
                "leased": self.buffer.shape[0] - len(self._free) - len(self._held)}
