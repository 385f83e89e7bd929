"""--pdl on a device that cannot take it: a clear error, never a silent fallback (the GPU side: test_pdl_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.layers import pdl


def test_auto_and_off_leave_pdl_off_on_the_cpu_and_on_is_an_error() -> None:
    cpu = torch.device("cpu")
    assert pdl.resolve("auto", cpu) is False
    assert pdl.resolve("off", cpu) is False
    with pytest.raises(ValueError, match=r"compute capability 9\.0"):
        pdl.resolve("on", cpu)
    with pytest.raises(ValueError, match="auto, on or off"):
        pdl.resolve("sometimes", cpu)


def test_the_launch_options_carry_the_kernels_wait_and_the_launch_flag_together() -> None:
    try:
        pdl.install(True)
        assert pdl.launch_kwargs() == {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}
        # a short kernel ahead of a skinny product lets it be scheduled before its own wait
        assert pdl.launch_kwargs(ahead_of_product=True) == {"PDL": pdl.TRIGGER_FIRST, "launch_pdl": True}
        pdl.trigger_early = False
        assert pdl.launch_kwargs(ahead_of_product=True) == {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}
    finally:
        pdl.install(False)
        pdl.trigger_early = True
    assert pdl.launch_kwargs() == {"PDL": pdl.OFF, "launch_pdl": False}
    assert pdl.launch_kwargs(ahead_of_product=True) == {"PDL": pdl.OFF, "launch_pdl": False}


def test_a_weight_is_prefetched_ahead_of_the_wait_only_with_pdl_on_and_the_bulk_prefetchs_alignment() -> None:
    aligned = torch.zeros(8, 64, dtype=torch.bfloat16)  # rows of 128 bytes
    assert aligned.data_ptr() % 16 == 0
    assert not pdl.prefetchable(aligned, 64)  # PDL off: nothing runs ahead to overlap
    try:
        pdl.install(True)
        assert pdl.prefetchable(aligned, 64)
        assert not pdl.prefetchable(torch.zeros(8, 900, dtype=torch.bfloat16), 900)  # 1,800-byte rows
        assert not pdl.prefetchable(torch.zeros(8, 72, dtype=torch.bfloat16)[:, 4:], 68)  # a start 8 bytes in
        assert pdl.prefetchable(torch.zeros(8, 64, dtype=torch.float8_e4m3fn), 64)
        assert not pdl.prefetchable(torch.zeros(8, 56, dtype=torch.float8_e4m3fn), 56)
        pdl.prefetch_weights = False
        assert not pdl.prefetchable(aligned, 64)
    finally:
        pdl.install(False)
        pdl.prefetch_weights = True
