"""The FP8 KV cache's store in Triton: what a kernel writes to the cache for a key or value it computed
(engine/quantization/kv_fp8.py has the scheme and the torch twin, `quantize_kv`)."""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value


@triton.jit
def to_cache(x, scale, CACHE_TY: tl.constexpr, FP8: tl.constexpr):
    """x (float32 holding a value of the model's dtype) as the cache stores it: cast, or with FP8 divided by
    `scale` (a scalar, or one per row of x; rounded to nearest, as torch divides, where `/` would be
    approximate), saturated at +-448 and rounded to e4m3."""
    if FP8:
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)  # div_rn does not broadcast its operands
        out = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(CACHE_TY)
    else:
        out = x.to(CACHE_TY)
    return out
