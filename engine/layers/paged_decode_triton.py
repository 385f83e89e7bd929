"""Paged decode attention for CUDA in Triton: flash-decoding over the page table.

One program per (sequence, KV head, split of the sequence): it loads its query heads (the GQA
group, padded to 16 rows for the tensor cores), walks its share of the sequence's tokens
through the page table, and keeps an online softmax. The splits are merged by their
log-sum-exp afterwards. Every shape is fixed by the batch size, so it replays in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.fused_triton import merge_splits


@triton.jit
def _paged_decode_split(
    Q, K, V, PageTable, Slots, SeqLens, OutAcc, OutLse,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    sm_scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(Slots + b)
    seq_len = tl.load(SeqLens + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=in_group[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(PageTable + slot * stride_pt + offs // PAGE_SIZE, mask=valid, other=0)
        loc = page.to(tl.int64) * PAGE_SIZE + offs % PAGE_SIZE
        k = tl.load(K + loc[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + loc[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_tokens = start < end
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_tokens, m_i + tl.log(safe_l), float("-inf"))
    tl.store(OutAcc + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=in_group[:, None])
    tl.store(OutLse + b * stride_lb + heads * stride_lh + split, lse, mask=in_group)


def num_splits_for(batch: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU twice over, at most 32 splits per sequence."""
    want = -(-2 * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(32, want))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           slots: torch.Tensor, seq_lens: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """q: [B, H, D]; caches: [tokens, Hkv, D]; returns [B, H, D] in q's dtype."""
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    splits = num_splits_for(bsz, num_kv_heads)
    acc = torch.empty(bsz, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, num_heads, splits, dtype=torch.float32, device=q.device)
    block_n = 64 if head_dim <= 128 else 32
    _paged_decode_split[(bsz, num_kv_heads, splits)](
        q, k_cache, v_cache, page_table, slots, seq_lens, acc, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        scale, PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_SPLITS=splits, num_warps=4, num_stages=2,
    )
    return merge_splits(acc, lse, q.dtype)  # splits with no tokens weigh 0
