"""RMSNorm's values as the engine rounds them, for the Triton kernels that make them (imports Triton: CUDA only)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps, cols, mask,
                    HAS_RESIDUAL: tl.constexpr):
    """rmsnorm(x [+ residual]) * weight of one row's `cols` (the whole row), rounded as the torch reference
    rounds (the sum to x's dtype, the normed row, then the product), in x's dtype: what add_rmsnorm writes,
    and what FP8's fused norm quantizes. With HAS_RESIDUAL the sum is stored at ResOut's row (the new
    residual)."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * inv).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(X.dtype.element_ty)
