"""SwiGLU's values as the engine rounds them, for the Triton kernels that make them (imports Triton: CUDA only)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul_row(GU, row, stride_gu, N, cols, mask, out_dtype: tl.constexpr):
    """silu(gate) * up at one [gate | up] row's `cols`, rounded as an `out_dtype` output is (silu, then the
    product), as float32: what silu_and_mul writes, and what FP8's fused SwiGLU quantizes."""
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + N + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(out_dtype)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(out_dtype).to(tl.float32)
