"""Programmatic dependent launch for the decode step's Triton kernels (Hopper and later).

A decode step at batch 1 is ~295 short kernels, each waiting for the one before it to finish
before it is even scheduled: the launch, the programs' start-up and the gaps between kernels
were ~120 µs of a 4.4 ms step on an H200 (benchmarks/decode_step_profile.py). With programmatic dependent
launch a kernel may be scheduled onto free multiprocessors while its predecessor still runs; it
waits (`griddepcontrol.wait`) for that predecessor's completion and memory before its first
load, so it computes exactly what it computed before, only its start-up overlaps.

Every kernel launched with it must wait before touching memory (`pdl_triton.wait_for_previous`
at its top): a kernel that did not would race the one before it. Kernels launched without it
keep the stream's plain ordering, so torch's own kernels between ours are unaffected. The one
exception is memory no kernel of the step writes: the skinny products ask the L2 for their weight
before they wait (`pdl_triton.prefetch_rows_l2`), so the weight's stream starts while the kernel
ahead (a norm, the attention, the SwiGLU: short, and far from the HBM's rate at decode rows) finishes.
"""

from __future__ import annotations

import torch

MODES = ("auto", "on", "off")  # --pdl
_enabled = False
prefetch_weights = True  # benchmarks turn these off to compare
trigger_early = True
# The kernels' PDL constexpr (pdl_triton.wait_for_previous): off; wait, then let the next kernel be scheduled;
# let it be scheduled, then wait.
OFF, WAIT_FIRST, TRIGGER_FIRST = 0, 1, 2


def supported(device: torch.device) -> bool:
    """griddepcontrol is an sm_90 instruction."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def resolve(mode: str, device: torch.device) -> bool:
    """--pdl auto|on|off on this device: auto is on where it is supported; on where it is not is an error."""
    if mode not in MODES:
        raise ValueError(f"--pdl must be auto, on or off, got {mode!r}")
    if mode == "off":
        return False
    if mode == "on" and not supported(device):
        raise ValueError(f"--pdl on needs a CUDA device of compute capability 9.0 or later, not {device}")
    return supported(device)


def install(on: bool) -> None:
    """Whether the kernels that take it launch with programmatic dependent launch from now on (every launch of
    them: decode, verify, prefill and mixed steps). One switch per process: the last runner built sets it."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    """Whether launches take programmatic dependent launch now."""
    return _enabled


def prefetchable(weight: torch.Tensor, row_bytes_of: int) -> bool:
    """Whether a kernel launched now may prefetch `weight` before its wait: with programmatic dependent launch
    on (without it nothing runs ahead to overlap), `prefetch_weights` set, and the bulk prefetch's 16-byte
    alignment held by the weight's start, its row stride and `row_bytes_of` elements of a row."""
    size = weight.element_size()
    return (_enabled and prefetch_weights and weight.data_ptr() % 16 == 0 and weight.stride(0) * size % 16 == 0
            and row_bytes_of * size % 16 == 0)


def launch_kwargs(ahead_of_product: bool = False) -> dict[str, int | bool]:
    """The kernel's PDL constexpr (its wait) and Triton's launch option, always together. `ahead_of_product`: a
    short kernel whose next kernel is usually a skinny product (a norm, the SwiGLU, the attention's merge) lets
    that one be scheduled before its own wait (TRIGGER_FIRST), so the product's weight prefetch overlaps
    this kernel's wait and run, while `trigger_early` is set."""
    on = _enabled  # read once: the pair must never disagree
    mode = (TRIGGER_FIRST if ahead_of_product and trigger_early else WAIT_FIRST) if on else OFF
    return {"PDL": mode, "launch_pdl": on}
