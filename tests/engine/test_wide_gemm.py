"""The wide-tile GEMM (engine/layers/wide_gemm_triton.py, timed by benchmarks/wide_gemm_sweep.py) against
torch: compiled on a CUDA device, in float16 and bfloat16; or, with no CUDA device, under Triton's
interpreter where Triton is installed and TRITON_INTERPRET=1 was set before it loaded (CI has neither:
skipped there, at no cost).

The interpreter runs float16 only: its bfloat16 dot is not exact (its products came out wrong by ~1e10 in
Triton 3.6). test_gpu_path.py also checks launches at an 8B shape (4096 x 14336), in bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_CUDA else [torch.float16]


def test_a_launch_must_cover_k_in_whole_steps() -> None:
    pytest.importorskip("triton")
    from splitserve.engine.layers.wide_gemm_triton import WideLaunch, launch_fits

    assert launch_fits(WideLaunch(64, 128, 64, 4, 4, 2), 14336)
    assert not launch_fits(WideLaunch(64, 64, 512, 4, 3, 3), 14336)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,launch,bias", [
    (70, 96, 256, (64, 32, 32, 4, 3, 1), True),  # rows and columns past the tiles' edge
    (64, 64, 256, (64, 64, 32, 4, 3, 2), False),  # K in two slices
    (100, 80, 384, (32, 64, 64, 4, 3, 3), True),  # three slices, a bias added after their sum
])
def test_wide_gemm_matches_torch(rows: int, n: int, k: int, launch: tuple, bias: bool, dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    from splitserve.engine.layers.wide_gemm_triton import WideLaunch, wide_gemm

    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    weight = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    y = wide_gemm(x, weight, b, WideLaunch(*launch))
    assert y.shape == (rows, n) and y.dtype == dtype and y.device == x.device
    ref = torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None)
    torch.testing.assert_close(y.float(), ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(wide_gemm(x, weight, b, WideLaunch(*launch)), y)  # the slices summed in one order
