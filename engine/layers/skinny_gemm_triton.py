"""Decode-sized matrix products on CUDA, in Triton: up to 16 rows times a weight, no split over K.

At decode batch sizes a projection is a stream over its weight. For the long-K products
(o_proj, down_proj) cuBLAS splits K and runs a separate reduction kernel, which with its
launch gap costs a few µs per projection inside the CUDA graph; the engine uses this kernel for
those and for the LM head (measured 0.84-0.97x cuBLAS's time at one row). qkv and gate_up, where
cuBLAS was as fast or faster, take it too: cuBLAS rounds a row differently at different row
counts, and a verify step's K+1 rows must give plain decoding's bits (issue 13). Here one program
streams BLOCK_N weight rows over the whole K, the input rows padded to a 16-row tensor-core tile, so
each row's result is the same whatever else is in the batch (greedy output does not depend on
who shares a step, up to 16 rows). float32 rows of any count go in such tiles too (one grid column
per tile, full-precision FMAs): float32 runs check exactness, and there every row count must agree.

Block shapes come from `benchmarks/gemv_sweep.py` on an H200 (Llama-3.1-8B projections).

Tried and dropped: building the input inside the kernel (RMSNorm folded into the accumulator,
SwiGLU on the fly). On the 16-row tile the prologue spilled registers and ran 3-6x slower than
cuBLAS; on one row it saved 70 µs of a 4.7 ms step, but made batch-1 numerics differ from
larger batches, so greedy tokens changed with how requests happened to be batched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.skinny import MAX_ROWS


@triton.jit
def _skinny_gemm(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & in_k[None, :], other=0.0)
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows[:, None] & (n[None, :] < N))


def _blocks(n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) measured best on an H200 for Llama-shaped projections (benchmarks/gemv_sweep.py)."""
    if dtype == torch.float32:  # full-precision FMA tiles: what fits in shared memory
        return 32, 64
    if 6144 <= n <= 32768:
        return 64, 256
    return 32, 512 if n <= 4096 else 256


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); x: [M, K], weight: [N, K], both with contiguous rows. Rows go in tiles of
    MAX_ROWS, each tile computed the same way, so a row's result does not depend on M; 16-bit inputs
    take the tensor cores, float32 full-precision FMAs (never TF32).

    `launch` (BLOCK_N, BLOCK_K, warps, stages) overrides the measured choice (the sweep tries them).
    """
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    full = x.dtype == torch.float32
    block_n, block_k, warps, stages = launch or (*_blocks(n, x.dtype), 4, 3 if full else 4)
    _skinny_gemm[(triton.cdiv(n, block_n), triton.cdiv(m, MAX_ROWS))](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if full else "tf32", num_warps=warps, num_stages=stages,
    )
    return y
