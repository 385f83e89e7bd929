"""FP8 products on CUDA (imported only there: the CPU never imports Triton).

- `skinny_fp8`: decode- and verify-sized rows. A stream over the weight: each program takes a 16-row tile of
  the 16-bit input and a BLOCK_N x BLOCK_K slice of the e4m3 weight per step over K, converts the slice to the
  input's dtype in registers (every e4m3 value is exact in bfloat16), one tensor-core product, float32
  accumulation in the same order whatever the row count (no split of K: a row's bits do not depend on the other
  rows), then the per-channel scale and the bias. The weight is read once at 1 byte a parameter, half the bytes
  of the bfloat16 skinny kernel (engine/layers/skinny_gemm_triton.py, whose tiling it follows).
- `quantize_rows`: activations to e4m3 per token (or with a static per-tensor scale) in one Triton kernel, the
  scales written as the [M, 1] float32 column `torch._scaled_mm` takes.
- `scaled_mm_linear`: prompt steps and large batches: e4m3 x e4m3 on the tensor cores (`torch._scaled_mm`,
  row-wise scales: the activation's per row, the weight's per output channel) into bfloat16.

Nothing here reads a value back to the host, and every scale is a device tensor the layer owns (weight_scale,
input_scale) or one the step computes on the device: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous

TILE_ROWS = 16
# engine/quantization/fp8.py's (not imported: it imports this module, lazily, on CUDA)
FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _skinny_fp8(X, W, WScale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    m = tl.program_id(0) * 16 + tl.arange(0, 16)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=(m < M)[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), acc, input_precision=DOT_PRECISION)
    scale = tl.load(WScale + n, mask=n < N, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_w8a8(X, W, WScale, XScale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, STATIC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                 MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    m = tl.program_id(0) * 16 + tl.arange(0, 16)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = m < M
    if STATIC:
        xs = tl.zeros([16], dtype=tl.float32) + tl.load(XScale).to(tl.float32)
    else:  # per token, as quantize_rows: the row's amax over 448 (the rows are small: L2 serves the re-reads)
        amax = tl.zeros([16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & (kk < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        xs = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & in_k[None, :], other=0.0)
        xq = tl.minimum(tl.maximum(x.to(tl.float32) / xs[:, None], -FP8_MAX), FP8_MAX).to(W.dtype.element_ty)
        # Each block's product is added in float32 here: e4m3 tensor-core accumulation keeps fewer bits.
        acc += tl.dot(xq, tl.trans(w))
    scale = tl.load(WScale + n, mask=n < N, other=0.0)
    acc = acc * xs[:, None] * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows[:, None] & (n < N)[None, :])


def skinny_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """skinny_fp8 on e4m3 tensor cores: each row quantized to e4m3 in the kernel (per token, or with the static
    `input_scale`), as quantize_rows quantizes the rows of scaled_mm_linear, so no weight is converted. Row-local:
    a row's bits do not depend on the other rows."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or (32, 512, 4, 4)
    _skinny_w8a8[(triton.cdiv(m, TILE_ROWS), triton.cdiv(n, block_n))](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        STATIC=input_scale is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=warps, num_stages=stages, **launch_kwargs())
    return y


def skinny_blocks(n: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, stages): the 16-bit skinny kernel's N blocks with twice its K (a weight byte each);
    not yet swept on an H200 (bench/fp8.py times the result)."""
    if dtype == torch.float32:
        return 32, 64, 3
    if 6144 <= n <= 32768:
        return 64, 512, 3
    return 32, 1024 if n <= 4096 else 512, 3


def skinny_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T (+ bias); x: [M, K] 16-bit or float32, weight: [N, K] e4m3,
    weight_scale: [N] float32. `launch` (BLOCK_N, BLOCK_K, warps, stages) overrides the choice (sweeps)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if launch is None:
        block_n, block_k, stages = skinny_blocks(n, x.dtype)
        launch = (block_n, block_k, 4, stages)
    block_n, block_k, warps, stages = launch
    _skinny_fp8[(triton.cdiv(m, TILE_ROWS), triton.cdiv(n, block_n))](
        x, weight, weight_scale, bias if bias is not None else weight_scale, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        **launch_kwargs(),
    )
    return y


@triton.jit
def _quantize_rows(X, Q, S, Static, K, stride_xm, stride_qm, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
                   MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    if STATIC:
        scale = tl.load(Static).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(Q + row * stride_qm + kk, q.to(Q.dtype.element_ty), mask=kk < K)


def quantize_rows(x: torch.Tensor, activation: str, input_scale: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 [M, 1]) of x [M, K]: per token, or with the static scale, in one kernel; per
    tensor from the rows (a two-pass reduction) in torch ops."""
    if activation == "dynamic-tensor" or x.stride(-1) != 1:
        xf = x.float()
        if activation == "static-tensor":
            scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
        elif activation == "dynamic-tensor":
            scale = (xf.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1, 1).expand(x.shape[0], 1)
        else:
            scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    static = activation == "static-tensor"
    assert not static or input_scale is not None
    _quantize_rows[(m,)](x, q, s, input_scale if static else s, k, x.stride(0), q.stride(0), STATIC=static,
                         FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=1024, num_warps=4, **launch_kwargs())
    return q, s


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias) with x quantized to e4m3 (per token, per tensor or static) and one
    row-wise scaled e4m3 GEMM (bfloat16 out); a weight-only scheme's rows ("none") are quantized per token."""
    xq, xs = quantize_rows(x, "dynamic-token" if activation == "none" else activation, input_scale)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)
