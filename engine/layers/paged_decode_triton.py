"""Paged decode attention for CUDA in Triton: flash-decoding over the page table.

One program per (sequence, KV head, split of the sequence): it loads its query heads (the GQA
group, padded to 16 rows for the tensor cores), walks its share of the sequence's tokens
through the page table, and keeps an online softmax. The splits are merged by their
log-sum-exp afterwards, by a second kernel: merging them in the last split to finish (counted per
sequence and KV head) ran the batch-1 step 1.6-2.1% slower (docs/fp8.md), its group's heads merged one
after the other where the kernel spreads them over programs. Every shape is fixed by the batch size, so it replays in
CUDA graphs.

With `new_kv`, the step's own token arrives unrotated, straight from the QKV projection: each
program applies RoPE to its query heads, the cached tokens are the sequence's earlier ones,
and the last split also attends to the new key and value from registers and writes them
(rotated) to the cache. That saves a decode step one kernel per layer (and its gap) at batch 1,
where launches are a tenth of the step. With one split per sequence (large batches) there is
nothing to merge: the program writes the final output, and no float32 partials go through memory.

A verify step runs as decode rows too: each of a request's K+1 positions is a row of its own,
with its own KV length over the same pages, so its attention is computed exactly as plain
decoding computes that position (same kernel, same splits, the new token from registers). Its
rows' keys and values are written first (`store_rotated_kv`, the same rotation, the same bits):
a row reads the positions before it from the cache, and another program of the same launch
must not be writing them meanwhile (`new_kv_stored`).

An FP8 cache (`scales` given): the e4m3 tiles are widened to the query's dtype for the products, the key
scale is folded into the softmax scale and the value scale into the output; the new token is stored
quantized and attended as stored (its e4m3 value from registers), so that it weighs what a later step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.decode_splits import num_splits_for
from splitserve.engine.layers.e4m3_triton import widen_e4m3_where_loaded
from splitserve.engine.layers.fused_triton import merge_splits
from splitserve.engine.layers.kv_fp8_triton import to_cache
from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous
from splitserve.engine.quantization.kv_fp8 import KVScales


def dot_precision(dtype: torch.dtype) -> str:
    """float32 attention multiplies in full float32 (the reference's precision), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class NewTokenKV:
    """The step's new key and value heads ([B, Hkv, D] views of the QKV output, not yet rotated),
    the RoPE tables and the cache location each is written to."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    out_cache_loc: torch.Tensor


@triton.jit
def _load_rotated(Ptr, Cos, Sin, pos, stride_cos, rows_mask, HEAD_DIM: tl.constexpr):
    """Rows [R, D] at Ptr (a [R, 1] pointer block) with RoPE applied at `pos`, in float32:
    x1 cos - x2 sin for the first half of each head, x2 cos + x1 sin for the second."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    x = tl.load(Ptr + d[None, :], mask=rows_mask, other=0.0).to(tl.float32)
    x_partner = tl.load(Ptr + partner[None, :], mask=rows_mask, other=0.0).to(tl.float32)
    cos = tl.load(Cos + pos * stride_cos + d % HALF)[None, :]
    sin = tl.load(Sin + pos * stride_cos + d % HALF)[None, :]
    return x * cos + sign[None, :] * x_partner * sin


@triton.jit
def _paged_decode_split(
    Q, K, V, PageTable, Slots, SeqLens, OutAcc, OutLse, Out,
    KNew, VNew, Cos, Sin, Loc, KScale, VScale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos,
    sm_scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSE_NEW: tl.constexpr, NEW_STORED: tl.constexpr,
    HEADS_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    if HEADS_FIRST:  # a sequence's KV heads in neighbouring programs: they read the same pages' rows
        kv_head = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(Slots + b)
    seq_len = tl.load(SeqLens + b)
    # With FUSE_NEW the cache holds the earlier tokens only; the new one is in registers, and
    # the last split takes it after its share of the cache.
    cached = seq_len - 1 if FUSE_NEW else seq_len
    per_split = tl.cdiv(tl.cdiv(cached, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * per_split, cached)
    end = tl.minimum(start + per_split, cached)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    if FUSE_NEW:  # rounded as the stored rotated q of the unfused path would be
        q = _load_rotated(Q + b * stride_qb + heads[:, None] * stride_qh, Cos, Sin, seq_len - 1, stride_cos,
                          in_group[:, None], HEAD_DIM).to(Q.dtype.element_ty)
    else:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)

    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:  # the key scale goes into the softmax scale, the value scale onto the output
        k_scale = tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
        sm_scale = sm_scale * k_scale
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(PageTable + slot * stride_pt + offs // PAGE_SIZE, mask=valid, other=0)
        loc = page.to(tl.int64) * PAGE_SIZE + offs % PAGE_SIZE
        k = tl.load(K + loc[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:
            k = widen_e4m3_where_loaded(k, Q.dtype.element_ty)  # exactly, where loaded (e4m3_triton)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + loc[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:
            v = widen_e4m3_where_loaded(v, Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = start < end
    if FUSE_NEW:
        has_tokens = has_tokens | (split == NUM_SPLITS - 1)
        if split == NUM_SPLITS - 1:  # the new token: stored once, attended from registers
            one = tl.full([1], 1, dtype=tl.int1)
            k_new = _load_rotated(KNew + b * stride_knb + kv_head * stride_knh + tl.zeros([1, 1], dtype=tl.int32),
                                  Cos, Sin, seq_len - 1, stride_cos, one[:, None], HEAD_DIM)
            v_new = tl.load(VNew + b * stride_vnb + kv_head * stride_vnh + d[None, :])
            if KV_FP8:  # rounded to the model's dtype first, as the prompt's keys are before they are stored
                k_new = k_new.to(Q.dtype.element_ty).to(tl.float32)
            k_new = to_cache(k_new, k_scale, K.dtype.element_ty, KV_FP8)
            v_new = to_cache(v_new.to(tl.float32), v_scale, V.dtype.element_ty, KV_FP8)
            if not NEW_STORED:
                new_loc = tl.load(Loc + b).to(tl.int64)
                tl.store(K + new_loc * stride_kt + kv_head * stride_kh + d[None, :], k_new)
                tl.store(V + new_loc * stride_vt + kv_head * stride_vh + d[None, :], v_new)
            qk_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * sm_scale  # [GROUP_PAD]
            m_new = tl.maximum(m_i, qk_new)
            p_new = tl.exp(qk_new - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
            m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    if KV_FP8:
        out = out * v_scale
    if NUM_SPLITS == 1:  # the whole sequence: the final output (the bits the merge of one split gives)
        tl.store(Out + b * stride_fb + heads[:, None] * stride_fh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=in_group[:, None])
    else:
        lse = tl.where(has_tokens, m_i + tl.log(safe_l), float("-inf"))
        tl.store(OutAcc + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
                 mask=in_group[:, None])
        tl.store(OutLse + b * stride_lb + heads * stride_lh + split, lse, mask=in_group)


@triton.jit
def _store_rotated_kv(KNew, VNew, Cos, Sin, Pos, Loc, K, V, KScale, VScale, stride_knb, stride_knh, stride_vnb,
                      stride_vnh, stride_cos, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr,
                      KV_FP8: tl.constexpr, PDL: tl.constexpr):
    """One row's key (rotated exactly as the decode kernel rotates it) and value into the cache."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    one = tl.full([1], 1, dtype=tl.int1)
    pos = tl.load(Pos + b)
    k_new = _load_rotated(KNew + b * stride_knb + kv_head * stride_knh + tl.zeros([1, 1], dtype=tl.int32),
                          Cos, Sin, pos, stride_cos, one[:, None], HEAD_DIM)
    v_new = tl.load(VNew + b * stride_vnb + kv_head * stride_vnh + d[None, :]).to(tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:  # as the decode kernel stores its new token
        k_new = k_new.to(KNew.dtype.element_ty).to(tl.float32)
        k_scale = tl.load(KScale + kv_head)
        v_scale = tl.load(VScale + kv_head)
    k_new = to_cache(k_new, k_scale, K.dtype.element_ty, KV_FP8)
    v_new = to_cache(v_new, v_scale, V.dtype.element_ty, KV_FP8)
    loc = tl.load(Loc + b).to(tl.int64)
    tl.store(K + loc * stride_kt + kv_head * stride_kh + d[None, :], k_new)
    tl.store(V + loc * stride_vt + kv_head * stride_vh + d[None, :], v_new)


def store_rotated_kv(new: NewTokenKV, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     scales: KVScales | None = None) -> None:
    """Writes every row's new key (rotated at its position) and value to the cache, with the bits the
    decode kernel's own store would write (quantized with `scales`: an FP8 cache)."""
    rows, num_kv_heads, head_dim = new.k.shape
    k_scale, v_scale = (scales.k, scales.v) if scales is not None else (new.cos, new.cos)  # read only with an FP8 cache
    _store_rotated_kv[(rows, num_kv_heads)](
        new.k, new.v, new.cos, new.sin, positions, new.out_cache_loc, k_cache, v_cache, k_scale, v_scale,
        new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1), new.cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), HEAD_DIM=head_dim,
        KV_FP8=scales is not None, **launch_kwargs(),
    )


# One split per sequence (large batches), heads of up to 128: measured on an H200 at 256 rows x 512-1024
# tokens (benchmarks/attention_sweep.py).
ONE_SPLIT_LAUNCH = (64, 2, 3, False)


def decode_launch(splits: int, head_dim: int) -> tuple[int, int, int, bool]:
    """(BLOCK_N, warps, stages, heads first) for a split count: a function of the split count alone,
    so that batch-invariant mode (one count at every batch) also runs one tiling at every batch."""
    if splits == 1 and head_dim <= 128:
        return ONE_SPLIT_LAUNCH
    return (64 if head_dim <= 128 else 32, 4, 2, False)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           slots: torch.Tensor, seq_lens: torch.Tensor, page_size: int, scale: float,
                           new_kv: NewTokenKV | None = None, launch: tuple[int, int, int, bool] | None = None,
                           splits: int | None = None, new_kv_stored: bool = False,
                           scales: KVScales | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches: [tokens, Hkv, D]; returns [B, H, D] in q's dtype.

    Without `new_kv`, q is rotated and the new token's KV is already in the cache. With it, q
    is not rotated yet and the kernel rotates it, and writes and attends the new key and value.
    `launch` (BLOCK_N, warps, stages, heads first) overrides `decode_launch` (the sweep tries them).
    `splits` fixes the number of splits per sequence (each count is its own compile; eager steps of
    any batch size pass one, so that they compile once). `new_kv_stored`: the new keys and values
    are in the cache already (store_rotated_kv; verify rows), the kernel only attends them.
    `scales`: the layer's key and value scales when the caches are FP8.
    """
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    splits = splits or num_splits_for(bsz, num_kv_heads)
    out = torch.empty(bsz, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits == 1:  # the kernel writes `out` itself; the partials' slots take any tensors of the right rank
        acc, lse = out.unsqueeze(2), out
    else:
        acc = torch.empty(bsz, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, num_heads, splits, dtype=torch.float32, device=q.device)
    block_n, warps, stages, heads_first = launch or decode_launch(splits, head_dim)
    # Without new_kv the kernel reads none of these; any tensors of the right rank fill the slots.
    new = new_kv or NewTokenKV(k=k_cache, v=v_cache, cos=q, sin=q, out_cache_loc=slots)
    k_scale, v_scale = (scales.k, scales.v) if scales is not None else (q, q)  # read only with an FP8 cache
    grid = (num_kv_heads, bsz, splits) if heads_first else (bsz, num_kv_heads, splits)
    _paged_decode_split[grid](
        q, k_cache, v_cache, page_table, slots, seq_lens, acc, lse, out,
        new.k, new.v, new.cos, new.sin, new.out_cache_loc, k_scale, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1), new.cos.stride(0),
        scale, PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_SPLITS=splits, FUSE_NEW=new_kv is not None,
        NEW_STORED=new_kv_stored, HEADS_FIRST=heads_first, DOT_PRECISION=dot_precision(q.dtype),
        KV_FP8=scales is not None, num_warps=warps, num_stages=stages, **launch_kwargs(),
    )
    return out if splits == 1 else merge_splits(acc, lse, q.dtype)  # splits with no tokens weigh 0
