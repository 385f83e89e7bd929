"""Paged extend attention for CUDA in Triton: prompt chunks of any lengths over their cached KV.

An extend batch flattens every sequence's new tokens into one dimension; each sequence's KV
(its cached prefix and this step's tokens, already rotated and stored) lives in pages. One
program takes one block of a sequence's queries for one KV head: its rows are the block's
tokens times the GQA group's query heads, so each key and value tile is loaded once for the
whole group. It walks the sequence's keys through the page table with an online softmax,
unmasked below the block's first query position and causally masked from there. No padding
to the longest sequence and no gathered copy of the KV: a step of many short prompts, or of
a chunk beside a long prefix, costs what its own tokens cost.

The host describes the work in an ExtendPlan (engine/layers/extend_plan.py): per chunk its
slot, first row, number of new tokens and KV length; per program its chunk and first query.

An FP8 cache (`scales` given): key and value tiles load as e4m3 and are widened to the query's dtype; the
key scale is folded into the softmax scale, the value scale multiplies the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.e4m3_triton import widen_e4m3_where_loaded
from splitserve.engine.layers.extend_plan import ExtendPlan, block_tokens, wide_tiles
from splitserve.engine.layers.paged_decode_triton import dot_precision
from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous
from splitserve.engine.quantization.kv_fp8 import KVScales

LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(q, K, V, PageTable, slot, n0, kv_end, q_pos, m_i, l_i, acc, qk_scale,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, kv_head,
                 PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One tile of keys [n0, n0 + BLOCK_N) into the online softmax of the block's rows."""
    d = tl.arange(0, HEAD_DIM)
    offs = n0 + tl.arange(0, BLOCK_N)
    valid = offs < kv_end
    page = tl.load(PageTable + slot * stride_pt + offs // PAGE_SIZE, mask=valid, other=0)
    loc = page.to(tl.int64) * PAGE_SIZE + offs % PAGE_SIZE
    k = tl.load(K + loc[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=valid[:, None], other=0.0)
    if KV_FP8:
        k = widen_e4m3_where_loaded(k, q.dtype)  # exactly, where loaded (e4m3_triton)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 units
    if CAUSAL:
        qk = tl.where((offs[None, :] <= q_pos[:, None]) & valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row that sees no key yet
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + loc[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
    if KV_FP8:
        v = widen_e4m3_where_loaded(v, q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_extend_kernel(
    Q, K, V, Out, PageTable, KScale, VScale,
    ChunkSlot, ChunkRow, ChunkLen, ChunkKvLen, BlockChunk, BlockStart,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_pt,
    qk_scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # after the RoPE + KV store kernel, which wrote the keys read here
    blk = tl.program_id(0)
    kv_head = tl.program_id(1)
    c = tl.load(BlockChunk + blk)
    m0 = tl.load(BlockStart + blk)
    slot = tl.load(ChunkSlot + c)
    row0 = tl.load(ChunkRow + c)
    q_len = tl.load(ChunkLen + c)
    kv_len = tl.load(ChunkKvLen + c)
    prefix = kv_len - q_len

    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    r = tl.arange(0, ROWS)
    tok = m0 + r // GROUP_PAD  # the row's query, within the chunk
    g = r % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    flat = (row0 + tok).to(tl.int64)
    q = tl.load(Q + flat[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    q_pos = prefix + tok
    if KV_FP8:  # the key scale into the softmax scale (log2 units); the value scale onto the output
        qk_scale = qk_scale * tl.load(KScale + kv_head)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    # Keys before the block's first query are visible to every row: no mask. From there on, causal.
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(kv_len, prefix + tl.minimum(m0 + BLOCK_M, q_len))
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, K, V, PageTable, slot, n0, kv_end, q_pos, m_i, l_i, acc, qk_scale,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, kv_head,
                                     PAGE_SIZE, HEAD_DIM, BLOCK_N, False, DOT_PRECISION, KV_FP8)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, K, V, PageTable, slot, n0, kv_end, q_pos, m_i, l_i, acc, qk_scale,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, kv_head,
                                     PAGE_SIZE, HEAD_DIM, BLOCK_N, True, DOT_PRECISION, KV_FP8)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(VScale + kv_head)
    tl.store(Out + flat[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           plan: ExtendPlan, page_size: int, scale: float, out: torch.Tensor,
                           launch: tuple[int, int, int, int] | None = None, scales: KVScales | None = None
                           ) -> torch.Tensor:
    """q: [T, H, D] (rotated; the step's KV already in the cache); writes the rows the plan covers
    into out [T, H, D] and returns it.

    `launch` (query tokens per program, BLOCK_N, warps, stages) overrides the measured choice (the
    sweep tries them; the plan must have been built with the same tokens per program). `scales`: the layer's
    key and value scales when the caches are FP8.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if plan.num_blocks == 0:
        return out
    wide = wide_tiles(head_dim, q.element_size())
    k_scale, v_scale = (scales.k, scales.v) if scales is not None else (q, q)  # read only with an FP8 cache
    # Measured on an H200 (benchmarks/attention_sweep.py): 256 rows x 128 keys, 8 warps, 3 stages.
    block_m, block_n, warps, stages = launch or (block_tokens(group, wide), 32 if wide else 128, 8,
                                                 2 if wide else 3)
    _paged_extend_kernel[(plan.num_blocks, num_kv_heads)](
        q, k_cache, v_cache, out, page_table, k_scale, v_scale,
        plan.chunk_slot, plan.chunk_row, plan.chunk_len, plan.chunk_kv_len, plan.block_chunk, plan.block_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0),
        scale * LOG2E,
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), KV_FP8=scales is not None,
        num_warps=warps, num_stages=stages,
        **launch_kwargs(),
    )
    return out
