"""What an MPS SM cap changes about the engine's GEMMs, on the CPU: reading the cap, telling small clusters, and
leaving CPU tensors to F.linear (tests/engine/test_sm_cap_gemms_gpu.py runs the GEMMs under a real cap)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.layers import gemm_algos
from splitserve.engine.layers.sm_cap_gemms import SM_PERCENT_ENV, relative_error, sm_cap_percent, small_clusters


@pytest.mark.parametrize("value,want", [("", None), ("60", 60), (" 40 ", 40), ("1", 1), ("100", None)])
def test_the_cap_is_read_from_mps_own_variable(value: str, want: int | None) -> None:
    assert sm_cap_percent({SM_PERCENT_ENV: value}) == want
    assert sm_cap_percent({}) is None


@pytest.mark.parametrize("value", ["sixty", "0", "101", "60%"])
def test_a_cap_that_is_not_a_percentage_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=SM_PERCENT_ENV):
        sm_cap_percent({SM_PERCENT_ENV: value})


def test_only_clusters_of_one_or_two_ctas_count_as_small() -> None:
    # cublasLtClusterShape_t: 0 auto, 2 1x1x1, 3 2x1x1, 4 4x1x1, 5 1x2x1, 6 2x2x1, 7 4x2x1, 8 1x4x1
    assert [shape for shape in range(12) if small_clusters({"cluster_shape": shape})] == [2, 3, 5]
    assert not small_clusters({})


def test_relative_error_is_infinite_for_outputs_that_are_not_finite() -> None:
    reference = torch.tensor([[1.0, -4.0]])
    assert relative_error(torch.tensor([[1.0, -3.0]]), reference) == pytest.approx(0.25)
    assert relative_error(torch.tensor([[float("nan"), -4.0]]), reference) == float("inf")


def test_a_capped_process_leaves_cpu_rows_to_f_linear() -> None:
    gemm_algos.install({}, sm_capped=True)
    try:
        x, w = torch.randn(32, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
        assert gemm_algos.lookup(x, w) is None and gemm_algos.lookup(x, w, biased=True) is None
    finally:
        gemm_algos.install({})
