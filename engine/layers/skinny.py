"""Which projections take the row-invariant Triton path, and which kernel computes them.

Kept apart from the kernels so that CPU machines, which have no Triton, import nothing of them.
Up to SKINNY_ROWS rows the skinny kernel (engine/layers/skinny_gemm_triton.py: 16-row tiles,
about cuBLAS's time); past that its tiles cost 1.8-4x cuBLAS (benchmarks/gemv_sweep.py), and 16-bit rows
take the wide-tile kernel (engine/layers/wide_gemm_triton.py: 64- or 128-row wgmma tiles, no split
of K, 1.0-1.3x cuBLAS's time at 64-256 rows in its sweep). Both accumulate each output over K in
the same order in float32, 16 products a step on the tensor cores, so a row's bits do not depend
on which of them computed it (tests/engine/test_gpu_path.py asserts it at 1-300 rows for every
projection of Llama-3.1-8B).
"""

from __future__ import annotations

import torch

MAX_ROWS = 16  # one tensor-core tile of rows; larger 16-bit batches go to cuBLAS unless a layer's limit is raised
SKINNY_ROWS = 32  # the skinny kernel's rows; past them the wide kernel (16-bit), whose bits are the same
# Whether the skinny kernel (16-row mma tiles) gives a row the wide kernel's (64-row wgmma tiles) bits.
# If not, a layer whose row-invariant limit reaches past SKINNY_ROWS takes the wide kernel at every
# row count (one kernel for all), and only layers within the skinny range keep the skinny kernel.
SKINNY_MATCHES_WIDE = True


def fits(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether a projection of these rows takes the row-invariant path: CUDA and 16-bit rows up to
    `max_rows` (the layer's `skinny_rows`: 16, or what a verifier raised it to), each row's bits then
    independent of the other rows and of their count (a verify step's K+1 rows of one request equal
    plain decoding's), or float32 rows of any count (full-precision FMAs, never TF32). cuBLAS picks
    its kernel, and its rounding, by M."""
    if not x.is_cuda or x.dim() != 2 or x.shape[0] == 0:
        return False
    if x.dtype == torch.float32:
        return True
    return x.shape[0] <= max_rows and x.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int = SKINNY_ROWS) -> torch.Tensor:
    """x @ weight.T (+ bias), row-invariant for a layer whose row-invariant limit is `max_rows`: the
    skinny kernel up to SKINNY_ROWS rows (and float32 at any count), the wide kernel's unsplit launch
    for the shape past them (at every row count if the limit is past SKINNY_ROWS and the two kernels'
    bits differ)."""
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    skinny_rows = SKINNY_ROWS if SKINNY_MATCHES_WIDE or max_rows <= SKINNY_ROWS else 0
    if x.shape[0] > skinny_rows and x.dtype != torch.float32:
        from splitserve.engine.layers.wide_gemm_triton import row_invariant_launch, wide_gemm

        launch = row_invariant_launch(weight.shape[0], weight.shape[1], x.shape[0])
        if launch is not None:
            return wide_gemm(x, weight, bias, launch)
    return skinny_gemm(x, weight, bias)
