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
        assert pdl.launch_kwargs() == {"PDL": True, "launch_pdl": True}
    finally:
        pdl.install(False)
    assert pdl.launch_kwargs() == {"PDL": False, "launch_pdl": False}
