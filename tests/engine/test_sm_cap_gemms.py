"""What an MPS SM cap changes about the engine's GEMMs, on the CPU: reading the cap, telling small clusters, and
leaving CPU tensors to F.linear (tests/engine/test_sm_cap_gemms_gpu.py runs the GEMMs under a real cap)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.layers import gemm_algos
from splitserve.engine.layers.sm_cap_gemms import (
    SM_PERCENT_ENV,
    projection_shapes,
    reference_product,
    relative_error,
    sm_cap_percent,
    small_clusters,
)


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


def test_a_capped_process_keeps_only_the_swept_algorithms_with_small_clusters() -> None:
    from splitserve.engine.layers.cublaslt import Algo

    small = Algo((1,) * 8, 0, 1.0, {"cluster_shape": 3})
    large = Algo((2,) * 8, 0, 1.0, {"cluster_shape": 4})
    table = {(256, 64, 32, torch.bfloat16): small, (2048, 64, 32, torch.bfloat16): large}
    try:
        gemm_algos.install(table, sm_capped=True)
        assert gemm_algos.active_table() == {(256, 64, 32, torch.bfloat16): small}
        gemm_algos.install(table)
        assert gemm_algos.active_table() == table
    finally:
        gemm_algos.install({})


def test_the_check_takes_each_projection_shape_once_per_row_count_past_the_skinny_rows() -> None:
    from splitserve.engine.layers.embedding import ParallelLMHead
    from splitserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
    from splitserve.engine.quantization.fp8 import online_scheme

    bf16 = torch.bfloat16
    model = torch.nn.ModuleList([
        ColumnParallelLinear(64, [96, 32], bias=True, dtype=bf16),  # qkv: 128 x 64
        RowParallelLinear(128, 64, bias=False, dtype=bf16),
        ColumnParallelLinear(64, [96, 32], bias=True, dtype=bf16),  # a second layer: the same shapes
        RowParallelLinear(128, 64, bias=False, dtype=torch.float32),  # float32 rows take the skinny kernel
        ColumnParallelLinear(64, [48], bias=False, dtype=bf16, quant=online_scheme(), fp8_storage=True),
        ParallelLMHead(1000, 64, dtype=bf16),
        torch.nn.Embedding(1000, 64),  # no projection
    ])
    sixteen_bit, fp8 = projection_shapes(model.modules(), [1, 16, 24, 24, 192])
    assert sorted((r, *w.shape) for r, w in sixteen_bit) == [(24, 64, 128), (24, 128, 64), (24, 1000, 64),
                                                             (192, 64, 128), (192, 128, 64), (192, 1000, 64)]
    assert [(r, layer.weight.shape[0]) for r, layer in fp8] == [(24, 48), (192, 48)]
    without_head, _ = projection_shapes(model.modules(), [24], lm_head=False)
    assert sorted((r, *w.shape) for r, w in without_head) == [(24, 64, 128), (24, 128, 64)]
    model[1].skinny_rows = 32  # a verifier's row-invariant rows: its 24-row steps stay off cuBLAS
    assert (24, 64, 128) not in [(r, *w.shape) for r, w in projection_shapes(model.modules(), [24])[0]]


def test_the_float32_reference_is_taken_a_block_of_columns_at_a_time() -> None:
    x, w = torch.randn(5, 16).to(torch.bfloat16), torch.randn(7, 16).to(torch.bfloat16)
    assert torch.allclose(reference_product(x, w, columns=3), x.float() @ w.float().t())
