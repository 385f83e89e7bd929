"""Programmatic dependent launch for the decode step's Triton kernels (Hopper and later).

A decode step at batch 1 is ~295 short kernels, each waiting for the one before it to finish
before it is even scheduled: the launch, the programs' start-up and the gaps between kernels
were ~120 µs of a 4.4 ms step on an H200 (benchmarks/decode_step_profile.py). With programmatic dependent
launch a kernel may be scheduled onto free multiprocessors while its predecessor still runs; it
waits (`griddepcontrol.wait`) for that predecessor's completion and memory before its first
load, so it computes exactly what it computed before, only its start-up overlaps.

Each kernel lets the next be scheduled right after its own wait. Letting it be scheduled before (a longer chain
of waiting kernels) ran the batch-1 step 0.6% slower in FP8 and in bfloat16 (docs/fp8.md).

Every kernel launched with it must wait before touching memory (`pdl_triton.wait_for_previous`
at its top): a kernel that did not would race the one before it. Kernels launched without it
keep the stream's plain ordering, so torch's own kernels between ours are unaffected.
"""

from __future__ import annotations

import torch

MODES = ("auto", "on", "off")  # --pdl
_enabled = False


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


def launch_kwargs() -> dict[str, bool]:
    """The kernel's PDL constexpr (its wait) and Triton's launch option, always together."""
    on = _enabled  # read once: the pair must never disagree
    return {"PDL": on, "launch_pdl": on}
