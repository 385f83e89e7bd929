"""Decode- and verify-sized matrix products on CUDA, in Triton: rows in 16-row tiles, no split over K.

At decode batch sizes a projection is a stream over its weight. For the long-K products
(o_proj, down_proj) cuBLAS splits K and runs a separate reduction kernel, which with its
launch gap costs a few µs per projection inside the CUDA graph; the engine uses this kernel for
those and for the LM head (measured 0.84-0.97x cuBLAS's time at one row). qkv and gate_up, where
cuBLAS was as fast or faster, take it too: cuBLAS rounds a row differently at different row
counts, and a verify step's K+1 rows per request must give plain decoding's bits (speculative decoding).

Every 16-row tile of the input is computed the same way, whatever the row count: one tensor-core
product of the tile with a BLOCK_N x BLOCK_K slice of the weight per step over K, accumulated in
float32 in the same order (no split over K). So a row's result does not depend on the other rows
nor on how many there are: greedy output does not depend on who shares a step, and a verify step
of B requests x (K+1) rows gives each row the bits of a plain decode step. A program takes up to
TILES such tiles (the weight slice loaded once for all of them) and programs of the same weight
slice run next to each other, so that at verify sizes (40-288 rows) the weight streams from HBM
about once, not once per tile. float32 rows go in the same tiles (full-precision FMAs, never
TF32): float32 runs check exactness.

Block shapes come from `benchmarks/gemv_sweep.py` on an H200 (Llama-3.1-8B projections).

Tried and dropped: building the input inside the kernel (RMSNorm folded into the accumulator,
SwiGLU on the fly). On the 16-row tile the prologue spilled registers and ran 3-6x slower than
cuBLAS; on one row it saved 70 µs of a 4.7 ms step, but made batch-1 numerics differ from
larger batches, so greedy tokens changed with how requests happened to be batched. SwiGLU alone on
the one row, rounded as silu_and_mul (the same bits, tested): one launch less a layer, but the down
projection ran ~3 µs slower a layer, so the graph's step at batch 1 went from 4,414 to 4,478 µs
(H200, A B A B in one run).

Under programmatic dependent launch (engine/layers/pdl.py) a program waits at its top for the kernel before it.
Also tried: an L2 prefetch of the weight blocks its pipeline loads first, issued before that wait (the weight does
not depend on the kernel before). It ran slower: the batch-1 graph's replay 4,356 against 4,251 us without it and
4,299 without PDL, batch 8 4,801 against 4,669 (H200, the three graphs in alternating rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous

TILE_ROWS = 16  # one tensor-core tile of rows
MAX_TILES = 4  # tiles per program (each tile still its own product: the bits do not change with it)
SMEM_BYTES = 200 * 1024  # what the pipeline stages may take of an H200 SM's shared memory


@triton.jit
def _tile_product(X, m, kk, in_k, M, stride_xm, wt, acc, DOT_PRECISION: tl.constexpr):
    x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=(m < M)[:, None] & in_k[None, :], other=0.0)
    return acc + tl.dot(x, wt, input_precision=DOT_PRECISION)


@triton.jit
def _store_tile(Y, m, n, M, N, stride_ym, acc, bias, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += bias[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_gemm(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 PDL: tl.constexpr):
    wait_for_previous(PDL)
    # Axis 0 (the fastest) walks the row tiles of one weight slice: they share it in L2.
    first = tl.program_id(0) * TILES * 16
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, 16)
    acc0 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        wt = tl.trans(w)
        acc0 = _tile_product(X, first + r, kk, in_k, M, stride_xm, wt, acc0, DOT_PRECISION)
        if TILES > 1:
            acc1 = _tile_product(X, first + 16 + r, kk, in_k, M, stride_xm, wt, acc1, DOT_PRECISION)
        if TILES > 2:
            acc2 = _tile_product(X, first + 32 + r, kk, in_k, M, stride_xm, wt, acc2, DOT_PRECISION)
            acc3 = _tile_product(X, first + 48 + r, kk, in_k, M, stride_xm, wt, acc3, DOT_PRECISION)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)
    _store_tile(Y, first + r, n, M, N, stride_ym, acc0, bias, HAS_BIAS)
    if TILES > 1:
        _store_tile(Y, first + 16 + r, n, M, N, stride_ym, acc1, bias, HAS_BIAS)
    if TILES > 2:
        _store_tile(Y, first + 32 + r, n, M, N, stride_ym, acc2, bias, HAS_BIAS)
        _store_tile(Y, first + 48 + r, n, M, N, stride_ym, acc3, bias, HAS_BIAS)


def _blocks(n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) measured best on an H200 for Llama-shaped projections (benchmarks/gemv_sweep.py).
    They depend on N only, never on the row count."""
    if dtype == torch.float32:  # full-precision FMA tiles: what fits in shared memory
        return 32, 64
    if 6144 <= n <= 32768:
        return 64, 256
    return 32, 512 if n <= 4096 else 256


def tiles_per_program(m: int, dtype: torch.dtype) -> int:
    """Row tiles one program computes: 1, 2 or 4 (float32: always 1, its tiles take the shared memory)."""
    tiles = triton.cdiv(m, TILE_ROWS)
    if dtype == torch.float32 or tiles == 1:
        return 1
    return 2 if tiles == 2 else MAX_TILES


def _stages(tiles: int, block_n: int, block_k: int, itemsize: int, full: bool) -> int:
    """Pipeline stages: 3 (float32) or 4 (16-bit) at one tile, fewer when the tiles' inputs would not
    fit in shared memory."""
    per_stage = (tiles * TILE_ROWS + block_n) * block_k * itemsize
    return max(1, min(3 if full else 4, SMEM_BYTES // per_stage))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); x: [M, K], weight: [N, K], both with contiguous rows. Rows go in tiles of
    16, each tile computed the same way, so a row's result does not depend on M; 16-bit inputs take
    the tensor cores, float32 full-precision FMAs (never TF32).

    `launch` (BLOCK_N, BLOCK_K, warps, stages) overrides the measured choice (the sweep tries them).
    """
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    full = x.dtype == torch.float32
    tiles = tiles_per_program(m, x.dtype)
    if launch is None:
        block_n, block_k = _blocks(n, x.dtype)
        launch = (block_n, block_k, 4, _stages(tiles, block_n, block_k, x.element_size(), full))
    block_n, block_k, warps, stages = launch
    _skinny_gemm[(triton.cdiv(m, tiles * TILE_ROWS), triton.cdiv(n, block_n))](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, TILES=tiles, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if full else "tf32", num_warps=warps, num_stages=stages, **launch_kwargs(),
    )
    return y
