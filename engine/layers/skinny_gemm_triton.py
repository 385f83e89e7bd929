"""Decode-sized matrix products on CUDA, in Triton: a few rows times a weight, with a fused prologue.

At decode batch sizes a projection is a stream over its weight, and what surrounds it in plain
torch costs more than it seems: cuBLAS splits the long-K products (o_proj, down_proj) and runs
a separate reduction kernel, and the RMSNorm before qkv/gate_up and the SwiGLU before down_proj
are kernels of their own, each with its launch gap inside the CUDA graph. Here one program
streams BLOCK_N weight rows over the whole K (no split, so no reduction), its input rows
padded to a 16-row tensor-core tile (PLAIN: x as is).
With one row (batch-1 decode, the latency-bound case) the input can also be built in the kernel:

- SILU_MUL: x = silu(gate) * up from the [M, 2K] gate/up projection (rounded as silu_and_mul);
- RMSNORM: x = (h [+ residual]) * norm_weight, with 1/rms(h [+ residual]) applied to the
  accumulator at the end (the sum of squares is gathered in the same pass over K), and program 0
  writing the new residual.

The prologue runs on a vector: done on all 16 rows of the tile, its registers spilled and the
kernel ran 3-6x slower than cuBLAS plus the separate kernel.

Block shapes come from `benchmarks/gemv_sweep.py` on an H200 (Llama-3.1-8B projections): there
these stream at 3.1-4.4 TB/s, 0.86-0.97x the time of cuBLAS for o_proj, down_proj and the LM head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.skinny import MAX_ROWS, PLAIN, SILU_MUL


@triton.jit
def _skinny_gemm(X, R, NormW, ResOut, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    rows = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_sq = tl.sum(tl.zeros([BLOCK_K], dtype=tl.float32), axis=0)  # a float32 scalar, carried by the loop
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        if PROLOGUE == 0:
            x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & in_k[None, :], other=0.0)
        else:
            # One row (M == 1): the prologue works on a vector, then fills row 0 of the tile.
            if PROLOGUE == 1:
                g = tl.load(X + kk, mask=in_k, other=0.0).to(tl.float32)
                u = tl.load(X + K + kk, mask=in_k, other=0.0)
                silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
                vec = (silu.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
            else:
                vec = tl.load(X + kk, mask=in_k, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(R + kk, mask=in_k, other=0.0)
                    vec = (vec.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the residual, rounded like torch
                    tl.store(ResOut + kk, vec, mask=in_k & (pid == 0))
                vf = vec.to(tl.float32)
                sum_sq += tl.sum(vf * vf, axis=0)
                vec = (vf * tl.load(NormW + kk, mask=in_k, other=0.0).to(tl.float32)).to(vec.dtype)
            x = tl.where(m[:, None] == 0, vec[None, :], 0.0).to(vec.dtype)
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if PROLOGUE == 2:
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows[:, None] & (n[None, :] < N))


def _blocks(n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) measured best on an H200 for Llama-shaped projections (benchmarks/gemv_sweep.py)."""
    if 6144 <= n <= 32768:
        return 64, 256
    return 32, 512 if n <= 4096 else 256


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  prologue: int = PLAIN, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = prologue(x) @ weight.T (+ bias), and the new residual for RMSNORM with a residual.

    x: [M, K] ([M, 2K] for SILU_MUL) with M <= MAX_ROWS; weight: [N, K], both contiguous rows.
    """
    m = x.shape[0]
    n, k = weight.shape
    assert m <= MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert prologue == PLAIN or m == 1, "the fused prologues take one row"
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), (tuple(x.shape), tuple(weight.shape))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    block_n, block_k = _blocks(n)
    _skinny_gemm[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else y, weight, bias if bias is not None else weight, y,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )
    return y, res_out
