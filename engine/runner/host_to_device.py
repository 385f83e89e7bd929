"""Host values to the device without stalling the queue of work already launched there.

`torch.tensor(values, device="cuda")` copies from pageable memory, and CUDA makes such a copy
wait until the device's queued work has drained: one per step would undo the overlap
scheduler. From pinned memory the copy is queued like a kernel instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_to_device(values: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Fills a contiguous device tensor from host values with one queued copy (through pinned memory)."""
    if out.device.type != "cuda":
        return out.copy_(torch.tensor(values, dtype=out.dtype))
    return out.copy_(torch.tensor(values, dtype=out.dtype, pin_memory=True), non_blocking=True)
