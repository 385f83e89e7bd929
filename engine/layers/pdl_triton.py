"""The wait every kernel launched with programmatic dependent launch starts with, and what may come before it
(engine/layers/pdl.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Blocks until the kernel before this one in the stream has finished and its writes are visible,
    and lets the next kernel be scheduled: it starts up while this one runs, and waits in turn. With
    PDL == 2 (pdl.TRIGGER_FIRST) the next kernel is let go before the wait: its own wait still holds it until
    this one has finished, so only when it is scheduled changes."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(rows, nbytes):
    """Asks the L2 for `nbytes` from each pointer of `rows` (one bulk prefetch a row: 16-byte aligned, a multiple
    of 16 bytes; pdl.prefetchable checks). Only for memory no kernel of the step writes, such as a weight: it may
    run before wait_for_previous. Nothing is loaded into registers; a duplicate row costs one instruction."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [rows, tl.zeros_like(rows.to(tl.int64)).to(tl.int32) + nbytes], dtype=tl.int32,
                              is_pure=False, pack=1)
