"""The wait every kernel launched with programmatic dependent launch starts with (engine/layers/pdl.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Blocks until the kernel before this one in the stream has finished and its writes are visible,
    then lets the next kernel be scheduled: it starts up while this one runs, and waits here in turn."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
