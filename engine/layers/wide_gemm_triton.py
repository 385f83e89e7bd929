"""Projections of 33-512 rows in Triton with output tiles chosen per launch: the row-invariant path past
the skinny kernel's range (engine/layers/skinny.py), used where a verifier raises its row-invariant
rows past 32 (batch-invariant mode).

The first idea: at 256 rows a decode step's projections are compute-bound, and cuBLAS's
large tiles might leave an H200's 132 SMs short of a wave, so 64-row tiles (Hopper's wgmma) or
split-K could fill it. Measured on the H200 (benchmarks/wide_gemm_sweep.py, 16 launches against
cuBLAS in the same run): cuBLAS was faster at 128-512 rows for every
Llama-3.1-8B projection (the best launch took 1.04-1.37x its time); only at 64 rows did one win
(gate_up 0.93x, lm_head 0.90x). So plain decoding keeps cuBLAS.

What the same sweep showed about rounding: every launch without a split of K gave exactly cuBLAS's
bits wherever cuBLAS did not split K itself (all of qkv, o_proj, gate_up and lm_head at 64-512
rows; down_proj at 512), whatever its tile (64 or 128 rows, 32-256 columns, 64 or 128 of K a step,
4 or 8 warps): each output is the same chain of 16-deep tensor-core products over K in order. So a
row's bits depend neither on the launch nor on the row count, and `row_invariant_launch` may pick
the fastest unsplit launch per row count. cuBLAS's own dependence on M is its choice of split-K.

A launch may split K into a few slices (split-K), each written as float32 partial sums and added by a
second kernel in slice order: no atomics, so the result is deterministic (the same bits every run),
but not the bits of an unsplit launch: the row-invariant path never splits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class WideLaunch(NamedTuple):
    """One tiling: output tiles of block_m x block_n, block_k per step over K, K cut in `split` slices."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int = 1


def launch_fits(launch: WideLaunch, k: int) -> bool:
    """Whether the tiling covers K exactly (each slice a whole number of block_k steps)."""
    return k % (launch.block_k * launch.split) == 0


# The fastest unsplit launch of the H200 sweep (wide_gemm_sweep_h200.json) per Llama-3.1-8B projection
# (N, K) and row count: up to 64, 128, 256 rows, and more.
ROW_BUCKETS = (64, 128, 256)
_NARROW = WideLaunch(64, 32, 128, 4, 4)
_MID = WideLaunch(64, 64, 128, 4, 4)
_WIDE = WideLaunch(64, 128, 64, 4, 4)
_WIDE_DEEP = WideLaunch(64, 128, 64, 4, 5)
_BIG = WideLaunch(128, 128, 64, 4, 4)
ROW_INVARIANT_LAUNCHES: dict[tuple[int, int], tuple[WideLaunch, WideLaunch, WideLaunch, WideLaunch]] = {
    (6144, 4096): (_MID, _WIDE_DEEP, _WIDE, _BIG),  # qkv
    (4096, 4096): (_NARROW, _MID, _WIDE_DEEP, _BIG),  # o_proj
    (28672, 4096): (_WIDE, _BIG, _BIG, _BIG),  # gate_up
    (4096, 14336): (_NARROW, _MID, _WIDE_DEEP, _BIG),  # down_proj
    (128256, 4096): (_WIDE_DEEP, _BIG, _BIG, _BIG),  # lm_head
}
_OTHER = WideLaunch(64, 64, 64, 4, 4)  # any other shape whose K is a multiple of 64


def row_invariant_launch(n: int, k: int, rows: int) -> WideLaunch | None:
    """The unsplit launch for `rows` rows of an N x K projection (None: K fits no launch here; the
    skinny kernel then takes every row count)."""
    bucket = sum(rows > b for b in ROW_BUCKETS)
    measured = ROW_INVARIANT_LAUNCHES.get((n, k))
    if measured is not None:
        return measured[bucket]
    return _OTHER if launch_fits(_OTHER, k) else None


# M is not specialized on: one compiled kernel per launch serves every row count (the sweep
# compiles each launch once, in parallel, and every row count then reuses it).
@triton.jit(do_not_specialize=["M"])
def _wide_gemm(X, W, Bias, Y, Partial, M, N, slice_len, stride_xm, stride_wn, stride_ym,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Axis 0 (the fastest) walks the row tiles of one weight slice: they read it from L2 together.
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # Rows and columns past the edge wrap around (loaded, never stored): the loads need no mask.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = pid_k * slice_len + tl.arange(0, BLOCK_K)
    x_ptr = X + rm[:, None] * stride_xm + rk[None, :]
    w_ptr = W + rn[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: the weight's transpose
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, slice_len, BLOCK_K):
        acc = tl.dot(tl.load(x_ptr), tl.load(w_ptr), acc)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (om < M)[:, None] & (on < N)[None, :]
    if SPLIT:
        tl.store(Partial + pid_k * M * N + om[:, None] * N + on[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + om[:, None] * stride_ym + on[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_slices(Partial, Bias, Y, M, N, stride_ym, HAS_BIAS: tl.constexpr, SLICES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The slices added in order 0, 1, ...: the same sum every run.
    om = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    on = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (om < M)[:, None] & (on < N)[None, :]
    offsets = om[:, None] * N + on[None, :]
    acc = tl.load(Partial + offsets, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(Partial + s * M * N + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + om[:, None] * stride_ym + on[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def wide_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: WideLaunch) -> torch.Tensor:
    """x @ weight.T (+ bias); x: [M, K], weight: [N, K], 16-bit, contiguous rows; K must fit the launch."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1 and launch_fits(launch, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = launch.split > 1
    partial = torch.empty(launch.split, m, n, dtype=torch.float32, device=x.device) if split else y
    bias_arg = bias if bias is not None else weight
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), launch.split)
    _wide_gemm[grid](x, weight, bias_arg, y, partial, m, n, k // launch.split, x.stride(0), weight.stride(0),
                     y.stride(0), HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=launch.block_m,
                     BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.warps,
                     num_stages=launch.stages)
    if split:
        _sum_slices[(triton.cdiv(m, 32), triton.cdiv(n, 128))](
            partial, bias_arg, y, m, n, y.stride(0), HAS_BIAS=bias is not None, SLICES=launch.split,
            BLOCK_M=32, BLOCK_N=128, num_warps=4)
    return y
