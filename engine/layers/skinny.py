"""Which projections take the decode-sized Triton path (engine/layers/skinny_gemm_triton.py).

Kept apart from the kernel so that CPU machines, which have no Triton, import nothing of it.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16  # one tensor-core tile of rows; larger batches go to cuBLAS


def fits(x: torch.Tensor) -> bool:
    """Whether a projection of these rows takes the skinny path: CUDA, decode-sized, 16-bit (Triton's
    float32 dot rounds inputs to TF32; float32 runs, which check exactness, stay on cuBLAS)."""
    return x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the skinny kernel."""
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    return skinny_gemm(x, weight, bias)
