"""Which projections take the decode-sized Triton path (engine/layers/skinny_gemm_triton.py).

Kept apart from the kernel so that CPU machines, which have no Triton, import nothing of it.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16  # one tensor-core tile of rows; larger 16-bit batches go to cuBLAS unless a layer's limit is raised


def fits(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether a projection of these rows takes the skinny path: CUDA and 16-bit rows up to `max_rows`
    (the layer's `skinny_rows`: 16, or what a verifier raised it to), each row's bits then independent
    of the other rows and of their count (a verify step's K+1 rows of one request equal plain
    decoding's), or float32 rows of any count (full-precision FMAs, never TF32). cuBLAS picks its
    kernel, and its rounding, by M."""
    if not x.is_cuda or x.dim() != 2 or x.shape[0] == 0:
        return False
    if x.dtype == torch.float32:
        return True
    return x.shape[0] <= max_rows and x.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the skinny kernel."""
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    return skinny_gemm(x, weight, bias)
