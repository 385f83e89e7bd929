"""Fused elementwise kernels for CUDA, in Triton: what would otherwise be dozens of tiny kernels.

A decode step of an 8B model runs about a thousand small elementwise kernels in plain torch
(casts, the RMSNorm reduction, RoPE's halves, the KV scatter, SwiGLU on strided halves, the
decode batch's index arithmetic); each costs a microsecond or more even inside a CUDA graph,
and in prefill the strided ones run far below bandwidth. These kernels do each step in one pass
and round exactly where the torch reference rounds, so both paths agree to the last bit in
bfloat16 wherever possible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.kv_fp8_triton import to_cache
from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous
from splitserve.engine.layers.rmsnorm_triton import add_rmsnorm_row
from splitserve.engine.layers.swiglu_triton import silu_mul_row
from splitserve.engine.quantization.kv_fp8 import KVScales


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = add_rmsnorm_row(X, R, W, ResOut, row, stride_x, stride_r, stride_ro, N, eps, cols, mask, HAS_RESIDUAL)
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rmsnorm(x [+ residual]) * weight over the last dim; returns (normed, new residual or None).

    `residual_out` (2-D, contiguous rows; may be `residual` itself: a program reads its row before it writes
    it) receives the new residual instead of a new tensor."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    n = shape[-1]
    if residual is not None:
        r2 = residual.reshape(-1, n)
        res_out = torch.empty_like(x2) if residual_out is None else residual_out.view(-1, n)
    else:
        r2, res_out = x2, out
    if x2.shape[0] == 0:  # a step that samples no row (engine/models/llama.py): no launch of an empty grid
        return out.view(shape), (res_out.view(shape) if residual is not None else None)
    _add_rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0),
                                        res_out.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                                        BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4,
                                        **launch_kwargs())
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    h = silu_mul_row(GU, row, stride_gu, N, cols, mask, Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, h.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [..., 2N] tensor holding [gate | up]."""
    shape = gate_up.shape
    gu = gate_up.reshape(-1, shape[-1])
    n = shape[-1] // 2
    out = torch.empty(gu.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if gu.shape[0] == 0:
        return out.view(*shape[:-1], n)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), n, BLOCK=block,
                                                                  **launch_kwargs())
    return out.view(*shape[:-1], n)


@triton.jit
def _rope_store_kernel(QKV, Pos, Cos, Sin, KCache, VCache, Loc, KScale, VScale,
                       stride_t, stride_cos, stride_kc_t, stride_kc_h, stride_vc_t, stride_vc_h,
                       NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                       Q_PAD: tl.constexpr, KV_PAD: tl.constexpr, STORE: tl.constexpr, KV_FP8: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(Pos + t)
    i = tl.arange(0, half)
    cos = tl.load(Cos + pos * stride_cos + i)
    sin = tl.load(Sin + pos * stride_cos + i)
    base = QKV + t * stride_t
    # q heads, rotated in place
    hq = tl.arange(0, Q_PAD)
    mq = (hq < NUM_Q)[:, None]
    q1p = base + hq[:, None] * HEAD_DIM + i[None, :]
    q1 = tl.load(q1p, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q1p + half, mask=mq, other=0.0).to(tl.float32)
    tl.store(q1p, (q1 * cos[None, :] - q2 * sin[None, :]).to(QKV.dtype.element_ty), mask=mq)
    tl.store(q1p + half, (q2 * cos[None, :] + q1 * sin[None, :]).to(QKV.dtype.element_ty), mask=mq)
    # k heads, rotated in place, then k and v into the cache
    hk = tl.arange(0, KV_PAD)
    mk = (hk < NUM_KV)[:, None]
    k1p = base + NUM_Q * HEAD_DIM + hk[:, None] * HEAD_DIM + i[None, :]
    k1 = tl.load(k1p, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k1p + half, mask=mk, other=0.0).to(tl.float32)
    r1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(QKV.dtype.element_ty)
    r2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(QKV.dtype.element_ty)
    tl.store(k1p, r1, mask=mk)
    tl.store(k1p + half, r2, mask=mk)
    if STORE:
        loc = tl.load(Loc + t).to(tl.int64)
        kc = KCache + loc * stride_kc_t + hk[:, None] * stride_kc_h + i[None, :]
        d = tl.arange(0, HEAD_DIM)
        vp = base + (NUM_Q + NUM_KV) * HEAD_DIM + hk[:, None] * HEAD_DIM + d[None, :]
        v = tl.load(vp, mask=mk, other=0.0)
        if KV_FP8:  # quantized per KV head (engine/layers/kv_fp8_triton.py)
            ks = tl.load(KScale + hk, mask=hk < NUM_KV, other=1.0)[:, None]
            vs = tl.load(VScale + hk, mask=hk < NUM_KV, other=1.0)[:, None]
            tl.store(kc, to_cache(r1.to(tl.float32), ks, KCache.dtype.element_ty, True), mask=mk)
            tl.store(kc + half, to_cache(r2.to(tl.float32), ks, KCache.dtype.element_ty, True), mask=mk)
            tl.store(VCache + loc * stride_vc_t + hk[:, None] * stride_vc_h + d[None, :],
                     to_cache(v.to(tl.float32), vs, VCache.dtype.element_ty, True), mask=mk)
        else:
            tl.store(kc, r1.to(KCache.dtype.element_ty), mask=mk)
            tl.store(kc + half, r2.to(KCache.dtype.element_ty), mask=mk)
            tl.store(VCache + loc * stride_vc_t + hk[:, None] * stride_vc_h + d[None, :],
                     v.to(VCache.dtype.element_ty), mask=mk)


def rope_and_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_q: int, num_kv: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      loc: torch.Tensor, scales: KVScales | None = None) -> None:
    """Rotates q and k of a fused [T, (Hq + 2 Hkv) * D] projection in place and writes k, v to the cache
    (quantized with `scales`: an FP8 cache)."""
    assert qkv.is_contiguous() and cos.is_contiguous()
    k_scale, v_scale = (scales.k, scales.v) if scales is not None else (cos, cos)  # read only with an FP8 cache
    _rope_store_kernel[(qkv.shape[0],)](
        qkv, positions, cos, sin, k_cache, v_cache, loc, k_scale, v_scale, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_Q=num_q, NUM_KV=num_kv, HEAD_DIM=head_dim, Q_PAD=triton.next_power_of_2(num_q),
        KV_PAD=triton.next_power_of_2(num_kv), STORE=True, KV_FP8=scales is not None, num_warps=4,
        **launch_kwargs(),
    )


@triton.jit
def _merge_splits_kernel(Acc, Lse, Out, stride_ab, stride_ah, stride_as, stride_lb, stride_lh, stride_ob, stride_oh,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    ms = s < NUM_SPLITS
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + s, mask=ms, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(Acc + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :], mask=ms[:, None],
                  other=0.0)
    out = tl.sum(acc * w[:, None], axis=0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


def merge_splits(acc: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Combines flash-decoding partial outputs [B, H, S, D] by their log-sum-exp [B, H, S]."""
    bsz, heads, splits, head_dim = acc.shape
    out = torch.empty(bsz, heads, head_dim, dtype=dtype, device=acc.device)
    _merge_splits_kernel[(bsz, heads)](acc, lse, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0),
                                       lse.stride(1), out.stride(0), out.stride(1), NUM_SPLITS=splits,
                                       SPLITS_PAD=max(2, triton.next_power_of_2(splits)), HEAD_DIM=head_dim,
                                       **launch_kwargs())
    return out


@triton.jit
def _decode_inputs_kernel(Ids, Pos, Slots, Relay, PageTable, IdsOut, Loc, SeqLens, LogitsIndex, stride_pt,
                          page_size, N, HAS_RELAY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    ids = tl.load(Ids + i, mask=m, other=0)
    pos = tl.load(Pos + i, mask=m, other=0)
    slot = tl.load(Slots + i, mask=m, other=0)
    if HAS_RELAY:
        relayed = tl.load(Relay + slot, mask=m & (ids < 0), other=0)
        ids = tl.where(ids >= 0, ids, relayed)
    page = tl.load(PageTable + slot * stride_pt + pos // page_size, mask=m, other=0).to(tl.int64)
    tl.store(IdsOut + i, ids, mask=m)
    tl.store(Loc + i, page * page_size + pos % page_size, mask=m)
    tl.store(SeqLens + i, pos + 1, mask=m)
    tl.store(LogitsIndex + i, i.to(tl.int64), mask=m)


def decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                  page_size: int, relay: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch's (token ids, KV locations, KV lengths, logits rows), int64 [B] each, in one kernel:
    ids of -1 taken from `relay[slot]`, each row's KV location from its page (positions are >= 0)."""
    assert page_table.stride(1) == 1
    n = input_ids.shape[0]
    ids, loc, seq_lens, logits_index = torch.empty(4, n, dtype=torch.int64, device=input_ids.device).unbind(0)
    if n:
        block = 256
        _decode_inputs_kernel[(triton.cdiv(n, block),)](
            input_ids, positions, slots, relay if relay is not None else input_ids, page_table, ids, loc, seq_lens,
            logits_index, page_table.stride(0), page_size, n, HAS_RELAY=relay is not None, BLOCK=block, num_warps=4,
            **launch_kwargs())
    return ids, loc, seq_lens, logits_index
