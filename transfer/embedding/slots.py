"""A pool of fixed-size embedding slots in one tensor, registered with Mooncake once.

A slot holds up to ``max_rows`` rows of ``hidden`` values. Prefill leases one per image item and
gives it back after the rows are copied out; a slot whose item failed is *fenced* instead: it
returns to the pool only once no write of the encoder can land in it any more (the receiver's
``WriteFence``, write_fence.py, decides when). The encoder uses a pool of its own as the source
of its writes and as its LRU cache of embeddings.
"""

from __future__ import annotations

import torch


class EmbeddingSlots:
    """``num_slots`` x ``max_rows`` x ``hidden`` rows; lease / free / fence by slot index."""

    def __init__(self, num_slots: int, max_rows: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(num_slots, max_rows, hidden, dtype=dtype, device=device)
        self.max_rows, self.hidden, self.dtype = max_rows, hidden, dtype
        self._free = list(range(num_slots - 1, -1, -1))
        self._fenced: set[int] = set()

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

    def lease(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def fence(self, slot: int) -> None:
        """Keeps ``slot`` out of use: a write of the failed item's encoder may still land in it."""
        self._fenced.add(slot)

    def unfence(self, slot: int) -> None:
        """No write can land in ``slot`` any more: it is free again."""
        self._fenced.remove(slot)
        self._free.append(slot)

    def counts(self) -> dict[str, int]:
        return {"free": len(self._free), "fenced": len(self._fenced),
                "leased": self.buffer.shape[0] - len(self._free) - len(self._fenced)}
