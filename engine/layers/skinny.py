"""Which projections take the decode-sized Triton path (engine/layers/skinny_gemm_triton.py).

Kept apart from the kernels so that CPU machines, which have no Triton, import nothing of it.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16  # one tensor-core tile of rows; larger batches go to cuBLAS
PLAIN, SILU_MUL, RMSNORM = 0, 1, 2  # how the kernel builds its input rows


def fits(x: torch.Tensor) -> bool:
    """Whether a projection of these rows takes the skinny path (CUDA, decode-sized)."""
    return x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS


def fits_fused(x: torch.Tensor) -> bool:
    """Whether the projection can also build its input (norm, SwiGLU) in its kernel: one row."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  prologue: int = PLAIN, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = prologue(x) @ weight.T (+ bias), and the new residual for RMSNORM with a residual."""
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    return skinny_gemm(x, weight, bias, prologue=prologue, residual=residual, norm_weight=norm_weight, eps=eps)
