"""FP8 products on CUDA (imported only there: the CPU never imports Triton).

- `skinny_fp8`: decode- and verify-sized rows. A stream over the weight: each program takes a 16-row tile of
  the 16-bit input and a BLOCK_N x BLOCK_K slice of the e4m3 weight per step over K, converts the slice to the
  input's dtype in registers (every e4m3 value is exact in bfloat16), one tensor-core product, float32
  accumulation in the same order whatever the row count, then the per-channel scale and the bias. K may be
  split in parts (a launch option; a choice of it must depend on the weight's shape alone), added in part
  order by the last part of a tile to finish (a layer's arrival counters; a second kernel without them), so a
  row's bits never depend on the other rows. The weight is read once at 1 byte a
  parameter, half the bytes of the bfloat16 skinny kernel (engine/layers/skinny_gemm_triton.py, whose tiling it
  follows).
- `skinny_fp8_rows`: the same rows given in e4m3 with their float32 scales (the norm's and SwiGLU's fused
  kernels write them, or `quantize_rows`): e4m3 x e4m3 on the tensor cores with the weight on the product's
  wide side (a 64-row weight tile times the 16 transposed rows: Hopper's e4m3 `wgmma`, which has no 16-row
  form), each K block's product added in float32; no widening, and the weight tile read as it is. The same K
  parts, and the same last-part sum, as `skinny_fp8`. Row-local: a row's bits do not depend on the other rows.
  Its rows come quantized: quantizing (or norming) them inside this product gave the same bits and a 1.27-1.53x
  slower batch-1 step (docs/fp8.md).
- `quantize_rows`: activations to e4m3 per token (or with a static per-tensor scale) in one Triton kernel, the
  scales written as the [M, 1] float32 column `torch._scaled_mm` takes.
- `scaled_mm_linear`: prompt steps and large batches: e4m3 x e4m3 on the tensor cores (`torch._scaled_mm`,
  row-wise scales: the activation's per row, the weight's per output channel) into bfloat16.
- `silu_mul_quantize`: the MLP's SwiGLU straight to the down projection's e4m3 rows and scales, one kernel where
  silu_and_mul and quantize_rows were two (the 16-bit rows between them are the largest activation of a prompt
  step: 2 x 14,336 values a token on Llama-3.1-8B).

Nothing here reads a value back to the host, and every scale is a device tensor the layer owns (weight_scale,
input_scale) or one the step computes on the device: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.e4m3_triton import widen_e4m3
from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous
from splitserve.engine.layers.rmsnorm_triton import add_rmsnorm_row
from splitserve.engine.layers.swiglu_triton import silu_mul_row

TILE_ROWS = 16
# engine/quantization/fp8.py's (not imported: it imports this module, lazily, on CUDA)
FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _scale_bias_store(acc, XScale, WScale, Bias, Y, m, n, M, N, stride_ym, HAS_XSCALE: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    if HAS_XSCALE:  # e4m3 rows: each row's own scale first
        acc = acc * tl.load(XScale + m, mask=m < M, other=0.0)[:, None]
    acc = acc * tl.load(WScale + n, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m < M)[:, None] & (n < N)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _finish_tile(acc, XScale, WScale, Bias, Y, Partial, Arrivals, m, n, M, N, stride_ym, HAS_XSCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, LAST_ADDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's float32 sum over its part of K: scaled and stored, or kept for the parts' sum."""
    if SPLITS == 1:
        _scale_bias_store(acc, XScale, WScale, Bias, Y, m, n, M, N, stride_ym, HAS_XSCALE, HAS_BIAS)
    else:  # this part's sum to the scratch; the parts are added in part order, here or by _sum_splits
        mask = (m < M)[:, None] & (n < N)[None, :]
        tl.store(Partial + (tl.program_id(2) * M + m[:, None]).to(tl.int64) * N + n[None, :], acc, mask=mask)
        if LAST_ADDS:
            # Count this part in; the last of the tile's parts to arrive adds them all. The barrier puts every
            # thread's stores before the count (released at GPU scope); the count's acquire puts the last one's
            # loads after every other part's stores.
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(Arrivals + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                total = tl.zeros([16, BLOCK_N], dtype=tl.float32)
                for split in range(SPLITS):  # in part order, whichever arrived last: the same bits every time
                    total += tl.load(Partial + (split * M + m[:, None]).to(tl.int64) * N + n[None, :], mask=mask,
                                     other=0.0, cache_modifier=".cg")
                _scale_bias_store(total, XScale, WScale, Bias, Y, m, n, M, N, stride_ym, HAS_XSCALE, HAS_BIAS)
                tl.atomic_xchg(Arrivals + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _skinny_fp8(X, W, WScale, Bias, Y, Partial, Arrivals, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, LAST_ADDS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    m = tl.program_id(0) * 16 + tl.arange(0, 16)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < k_end
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=(m < M)[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(widen_e4m3(w, X.dtype.element_ty)), acc, input_precision=DOT_PRECISION)
    _finish_tile(acc, WScale, WScale, Bias, Y, Partial, Arrivals, m, n, M, N, stride_ym, False, HAS_BIAS, SPLITS,
                 LAST_ADDS, BLOCK_N)


@triton.jit
def _skinny_fp8_rows(XQ, XS, W, WScale, Bias, Y, Partial, Arrivals, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                     stride_ym, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, LAST_ADDS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    m = tl.program_id(0) * 16 + tl.arange(0, 16)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc_t = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < k_end
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(XQ + m[:, None] * stride_xm + kk[None, :], mask=(m < M)[:, None] & in_k[None, :], other=0.0)
        # The weight tile as the wide side. Each block's product is added here in float32: the e4m3 tensor
        # cores' own accumulation keeps fewer bits.
        acc_t += tl.dot(w, tl.trans(x))
    _finish_tile(tl.trans(acc_t), XS, WScale, Bias, Y, Partial, Arrivals, m, n, M, N, stride_ym, True, HAS_BIAS,
                 SPLITS, LAST_ADDS, BLOCK_N)


@triton.jit
def _sum_splits(Partial, XScale, WScale, Bias, Y, M, N, stride_ym, HAS_XSCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(SPLITS):  # always in this order: a row's bits do not depend on which program ran first
        acc += tl.load(Partial + (split * M + row).to(tl.int64) * N + n, mask=n < N, other=0.0)
    if HAS_XSCALE:
        acc = acc * tl.load(XScale + row)
    acc = acc * tl.load(WScale + n, mask=n < N, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + n, acc.to(Y.dtype.element_ty), mask=n < N)


# The K split's scratch (parts x rows x N float32) is cheap at decode rows and not past this many: a layer that
# sends more rows down the skinny path (a batch-invariant verifier's) launches unsplit for every row count, so a
# row's bits still do not depend on how many rows share its step.
SPLIT_MAX_ROWS = 32


def skinny_launch(n: int, k: int, dtype: torch.dtype, max_rows: int = 16) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, K parts) of the skinny FP8 kernel for an [n, k] weight, in a layer that
    sends up to `max_rows` rows down the skinny path.

    Swept on an H100 (benchmarks/fp8_gemv_sweep.py, Llama-3.1-8B's projections at 1 and 8 rows): 32 x 256 tiles
    with K split in 3-6 parts won every product, 0.58-0.78x the 16-bit kernel's time, where the best unsplit
    launches took 0.69-1.19x. A narrow product (qkv, o_proj, down: 128-192 N blocks on 132 SMs) needs the parts
    for enough loads in flight; a wide one (gate_up) gains from the shorter K loop; the long K of down takes 6.
    Tensor-parallel shards of those widths were not swept."""
    if dtype == torch.float32:
        return 32, 64, 4, 3, 1
    splits = 1 if max_rows > SPLIT_MAX_ROWS else 6 if k > 8192 else 4 if 4096 < n <= 8192 else 3
    return 32, 256, 4, 3, splits


def arrival_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 counters for skinny_fp8's K parts on an [n, K] weight: one per (16-row tile, BLOCK_N block)
    of any launch up to SPLIT_MAX_ROWS rows. A layer owns its own (made with its weight, outside graph
    capture); every launch leaves them at zero."""
    return torch.zeros(triton.cdiv(SPLIT_MAX_ROWS, TILE_ROWS) * triton.cdiv(n, 16), dtype=torch.int32, device=device)


@dataclass(frozen=True)
class KParts:
    """How a skinny launch splits K: the K each part covers, the part count (no part empty), the (row tiles,
    BLOCK_N blocks) grid, whether the last part of a tile to arrive adds the parts (else _add_parts_after's
    second kernel does), and the float32 scratch the parts' sums go to (the output itself when unsplit)."""

    k_per_split: int
    splits: int
    tiles: tuple[int, int]
    last_adds: bool
    partial: torch.Tensor


def _k_parts(y: torch.Tensor, k: int, block_n: int, block_k: int, splits: int,
             arrivals: torch.Tensor | None) -> KParts:
    """The K parts of a skinny launch writing y [M, N]; counters too few for its tiles are refused."""
    m, n = y.shape
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # no empty part
    tiles = (triton.cdiv(m, TILE_ROWS), triton.cdiv(n, block_n))
    last_adds = splits > 1 and arrivals is not None
    if last_adds and arrivals.numel() < tiles[0] * tiles[1]:
        raise ValueError(f"{arrivals.numel()} arrival counters for {tiles[0]} x {tiles[1]} tiles "
                         f"({m} rows, BLOCK_N {block_n}): arrival_counters sizes them up to {SPLIT_MAX_ROWS} rows")
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=y.device) if splits > 1 else y
    return KParts(k_per_split, splits, tiles, last_adds, partial)


def _add_parts_after(parts: KParts, y: torch.Tensor, xs: torch.Tensor | None, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
    """Where K was split and no counters let the last part add them: the parts' sums into y, in part order, with
    the row scales xs (e4m3 rows) and the weight's, then the bias."""
    if parts.splits == 1 or parts.last_adds:
        return
    m, n = y.shape
    _sum_splits[(m, triton.cdiv(n, 1024))](parts.partial, xs if xs is not None else weight_scale, weight_scale,
                                           bias if bias is not None else weight_scale, y, m, n, y.stride(0),
                                           HAS_XSCALE=xs is not None, HAS_BIAS=bias is not None, SPLITS=parts.splits,
                                           BLOCK=1024, num_warps=4, **launch_kwargs())


def skinny_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, launch: tuple[int, ...] | None = None,
               max_rows: int = 16, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T (+ bias); x: [M, K] 16-bit or float32, weight: [N, K] e4m3,
    weight_scale: [N] float32. `launch` (BLOCK_N, BLOCK_K, warps, stages[, splits]) overrides the choice (sweeps);
    `max_rows`: the most rows the calling layer sends to this kernel (skinny_launch splits K only up to 32).
    With K split in parts (more programs, more loads in flight for a narrow product), each part's float32 sum
    goes to a scratch tensor and they are added in part order: by the last part of each tile to finish, counted
    in `arrivals` (arrival_counters; the launches that share them must not overlap: one stream), or without
    counters by a second kernel. Either way a row's bits do not depend on the other rows, as long as the part
    count does not depend on them either, and both ways give the same bits."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if launch is None:
        launch = skinny_launch(n, k, x.dtype, max_rows)
    block_n, block_k, warps, stages = launch[:4]
    parts = _k_parts(y, k, block_n, block_k, launch[4] if len(launch) > 4 else 1, arrivals)
    bias_arg = bias if bias is not None else weight_scale
    _skinny_fp8[(*parts.tiles, parts.splits)](
        x, weight, weight_scale, bias_arg, y, parts.partial, arrivals if parts.last_adds else weight_scale, m, n, k,
        parts.k_per_split, x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        SPLITS=parts.splits, LAST_ADDS=parts.last_adds, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        **launch_kwargs(),
    )
    _add_parts_after(parts, y, None, weight_scale, bias)
    return y


def skinny_rows_launch(n: int, k: int, max_rows: int = 16) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, K parts) of skinny_fp8_rows for an [n, k] weight, in a layer that sends
    up to `max_rows` rows down the skinny path.

    Swept on an H100 (benchmarks/fp8_w8a8_skinny.py, Llama-3.1-8B's projections at 1 and 8 rows): 64-row weight
    tiles won, 512 of K a step for the narrow products (qkv, o_proj, down, whose long K takes 2 parts), 256 with
    a stage more for the wide gate_up. Parts only up to SPLIT_MAX_ROWS rows, as skinny_launch's."""
    splits = 2 if k > 8192 and max_rows <= SPLIT_MAX_ROWS else 1
    return (64, 256, 4, 4, splits) if n > 16384 else (64, 512, 4, 3, splits)


def skinny_fp8_rows(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, launch: tuple[int, ...] | None = None,
                    max_rows: int = 16, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """(xq * xs) @ (weight * weight_scale[:, None]).T (+ bias) in `out_dtype`, for e4m3 rows xq [M, K] with
    float32 scales xs [M, 1] (quantize_rows', rmsnorm_quantize's, silu_mul_quantize's) and an e4m3 weight [N, K].
    `launch`, `max_rows`, `arrivals`: as skinny_fp8's (skinny_rows_launch chooses; BLOCK_N at least 64, the
    weight's side of the e4m3 product). Row-local, whatever the part count."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == torch.float8_e4m3fn and weight.dtype == torch.float8_e4m3fn
    assert weight.shape[1] == k and xq.stride(-1) == 1 and weight.stride(-1) == 1 and xs.shape == (m, 1)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    block_n, block_k, warps, stages, splits = launch or skinny_rows_launch(n, k, max_rows)
    if block_n < 64:
        raise ValueError(f"BLOCK_N {block_n}: the weight's side of the e4m3 product needs at least 64 rows")
    parts = _k_parts(y, k, block_n, block_k, splits, arrivals)
    bias_arg = bias if bias is not None else weight_scale
    _skinny_fp8_rows[(*parts.tiles, parts.splits)](
        xq, xs, weight, weight_scale, bias_arg, y, parts.partial, arrivals if parts.last_adds else weight_scale, m,
        n, k, parts.k_per_split, xq.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        SPLITS=parts.splits, LAST_ADDS=parts.last_adds, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        num_stages=stages, **launch_kwargs())
    _add_parts_after(parts, y, xs, weight_scale, bias)
    return y


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def e4m3_products(device: torch.device) -> bool:
    """Whether the device multiplies e4m3 by e4m3 on its tensor cores (compute capability 8.9 and up, as
    torch._scaled_mm needs): where decode rows may go W8A8 (skinny_fp8_rows)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@triton.jit
def _row_scale(h, S, Static, row, STATIC: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's e4m3 scale, stored at S[row]: the static one, or the largest |h| over FP8_MAX (at least MIN_SCALE).
    `h` is the whole row, or a two-pass kernel's running max of |row| (|max| is that max: the same bits)."""
    if STATIC:
        scale = tl.load(Static).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(h), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(S + row, scale)
    return scale


@triton.jit
def _store_e4m3(h, scale, Q, row, stride_qm, cols, mask, FP8_MAX: tl.constexpr):
    """Values of a row over its scale, clamped to e4m3's range and stored as e4m3 at Q[row, cols]."""
    q = tl.minimum(tl.maximum(h / scale, -FP8_MAX), FP8_MAX)
    tl.store(Q + row * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(X, Q, S, Static, K, stride_xm, stride_qm, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
                   MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    if ONE_PASS:  # the whole row in registers: read once
        kk = tl.arange(0, BLOCK_K)
        x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        scale = _row_scale(x, S, Static, row, STATIC, FP8_MAX, MIN_SCALE)
        _store_e4m3(x, scale, Q, row, stride_qm, kk, kk < K, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        if not STATIC:
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(amax, S, Static, row, STATIC, FP8_MAX, MIN_SCALE)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
            _store_e4m3(x, scale, Q, row, stride_qm, kk, kk < K, FP8_MAX)


# A row of at most this many elements is held in registers and read once (a [rows, 4096] input, SwiGLU's 14,336
# columns); a wider one is read twice, for its amax and then for its values (the second read mostly from L2).
ONE_PASS_MAX = 16384


def fits_one_pass(width: int) -> bool:
    """Whether a row of `width` elements, padded to a power of two, is held in one program's registers."""
    return triton.next_power_of_2(width) <= ONE_PASS_MAX


def row_launch(width: int, loop_block: int) -> tuple[int, bool, int]:
    """(block, one pass, warps) of a per-row kernel over `width` elements: the whole row at once where it fits
    ONE_PASS_MAX, with a warp per 1,024 elements (4 to 16); else `loop_block` at a time, in two passes."""
    if fits_one_pass(width):
        block = triton.next_power_of_2(width)
        return block, True, min(16, max(4, block // 1024))
    return loop_block, False, 8


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
    block, one_pass, warps = row_launch(k, 1024)
    _quantize_rows[(m,)](x, q, s, input_scale if static else s, k, x.stride(0), q.stride(0), STATIC=static,
                         FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=block, ONE_PASS=one_pass, num_warps=warps,
                         **launch_kwargs())
    return q, s


@triton.jit
def _silu_mul_quantize(GU, Q, S, Static, N, stride_gm, stride_qm, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
                       MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    out_dtype = GU.dtype.element_ty
    if ONE_PASS:  # the whole row in registers: gate and up read once
        cols = tl.arange(0, BLOCK)
        h = silu_mul_row(GU, row, stride_gm, N, cols, cols < N, out_dtype)
        scale = _row_scale(h, S, Static, row, STATIC, FP8_MAX, MIN_SCALE)
        _store_e4m3(h, scale, Q, row, stride_qm, cols, cols < N, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:  # the row's amax first (the row is computed twice: reading it again costs less than writing it)
            for c0 in range(0, N, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(silu_mul_row(GU, row, stride_gm, N, cols, cols < N, out_dtype)))
        scale = _row_scale(amax, S, Static, row, STATIC, FP8_MAX, MIN_SCALE)
        for c0 in range(0, N, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            h = silu_mul_row(GU, row, stride_gm, N, cols, cols < N, out_dtype)
            _store_e4m3(h, scale, Q, row, stride_qm, cols, cols < N, FP8_MAX)


def silu_mul_quantize(gate_up: torch.Tensor, activation: str, input_scale: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, N], float32 [M, 1]) of silu(gate) * up for a [M, 2N] gate_up, in one kernel: the bits
    quantize_rows(silu_and_mul(gate_up), activation, input_scale) gives, without writing and reading the 16-bit
    rows between them. Per token ("dynamic-token"; "none": a weight-only checkpoint's rows) or static.
    One program a row: seven a row, meeting at a counter for the row's amax, gave the same bits and a 0.7% slower
    batch-1 step (docs/fp8.md)."""
    if activation == "dynamic-tensor":  # the one scheme outside fp8.ROW_QUANTIZED_ACTIVATIONS
        raise ValueError("a dynamic per-tensor activation scale needs the whole tensor's amax first")
    assert gate_up.stride(-1) == 1
    m, n = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    static = activation == "static-tensor"
    assert not static or input_scale is not None
    block, one_pass, warps = row_launch(n, 2048)
    _silu_mul_quantize[(m,)](gate_up, q, s, input_scale if static else s, n, gate_up.stride(0), q.stride(0),
                             STATIC=static, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, ONE_PASS=one_pass,
                             num_warps=warps, **launch_kwargs())
    return q, s


@triton.jit
def _rmsnorm_quantize(X, R, W, ResOut, Q, S, Static, stride_x, stride_r, stride_ro, stride_qm, N, eps,
                      HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, FP8_MAX: tl.constexpr,
                      MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps, cols, mask,
                        HAS_RESIDUAL).to(tl.float32)
    scale = _row_scale(h, S, Static, row, STATIC, FP8_MAX, MIN_SCALE)
    _store_e4m3(h, scale, Q, row, stride_qm, cols, mask, FP8_MAX)


def rmsnorm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                     residual_out: torch.Tensor | None, activation: str, input_scale: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 [M, N], float32 [M, 1], new residual or None) of rmsnorm(x [+ residual]) * weight for 2-D x, in
    one kernel: the bits of add_rmsnorm then quantize_rows(..., activation, input_scale), without writing and
    reading the 16-bit rows between them; rows of at most ONE_PASS_MAX values. `residual_out` as
    add_rmsnorm's. Per token or static (as silu_mul_quantize)."""
    if activation == "dynamic-tensor":
        raise ValueError("a dynamic per-tensor activation scale needs the whole tensor's amax first")
    m, n = x.shape
    assert x.stride(-1) == 1 and fits_one_pass(n)  # RMSNorm.forward_quantized checks
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if residual is not None:
        res_out = torch.empty_like(x) if residual_out is None else residual_out.view(-1, n)
        r = residual
    else:
        r = res_out = x
    static = activation == "static-tensor"
    assert not static or input_scale is not None
    if m:
        _rmsnorm_quantize[(m,)](x, r, weight, res_out, q, s, input_scale if static else s, x.stride(0), r.stride(0),
                                res_out.stride(0), q.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                                STATIC=static, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4, **launch_kwargs())
    return q, s, (res_out if residual is not None else None)


def scaled_mm_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """xq (e4m3, row scales xs [M, 1]) @ dequant(weight).T, one row-wise scaled e4m3 GEMM."""
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """x @ dequant(weight).T (+ bias) with x quantized to e4m3 (per token, per tensor or static) and one
    row-wise scaled e4m3 GEMM (bfloat16 out); a weight-only scheme's rows ("none") are quantized per token."""
    xq, xs = quantize_rows(x, "dynamic-token" if activation == "none" else activation, input_scale)
    y = scaled_mm_quantized(xq, xs, weight, weight_scale, x.dtype)
    return y if bias is None else y.add_(bias)
