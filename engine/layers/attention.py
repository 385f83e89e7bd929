"""Paged attention over the KV pool.

New keys and values are written into the pool at each token's slot, then:
- a plain causal prefill (no cached prefix, one sequence) goes straight to SDPA's causal
  kernel; on CUDA after the runner's warm-up, through cuDNN at a bucket length the warm-up built
  (past 4,096 tokens a coarse one, built on first use; engine/layers/prompt_attention.py);
- other extend batches (prompt chunks, mixed with decodes) on CUDA: the leading decode rows
  through the paged decode kernel, the chunks through the paged extend kernel, both reading
  the pages in place, but full prompt chunks after whole chunks, which gather their KV and
  take cuDNN (engine/layers/prefix_chunk_attention.py); elsewhere (the reference) each
  sequence's whole KV is gathered from its pages and padded to the longest, with a causal
  mask offset by the cached length, for one SDPA call;
- decode batches use the Triton flash-decoding kernel on CUDA, and a gather + SDPA reference
  everywhere else (the same maths, used to test the kernel). A verify step is a decode batch
  whose rows share slots (a request's K+1 positions, each a row): every row's KV is stored
  first, then each row attends as plain decoding at its position would.
With an FP8 pool (`scales` given), every path reads the e4m3 pages and dequantizes them
(engine/quantization/kv_fp8.py): the kernels in registers, the torch paths on the gathered copy; a fresh
prompt attends to its keys and values read back from the pages, as any later step reads them. On GPUs with
e4m3 tensor cores, a lone fresh prompt and the full chunks after whole chunks multiply them as e4m3
(engine/layers/e4m3_prompt_attention.py) where they would widen them for cuDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.prompt_attention import lone_prompt_attention
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.engine.quantization.kv_fp8 import KVScales, quantize_kv, read_kv
from splitserve.engine.runner.forward_batch import ForwardBatch


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, scales: KVScales | None = None) -> None:
    """Writes k, v [T, Hkv, D] at `loc`: cast to the cache's dtype, or quantized with `scales` (FP8 pool)."""
    if scales is None:
        k_cache[loc] = k.to(k_cache.dtype)
        v_cache[loc] = v.to(v_cache.dtype)
    else:
        k_cache[loc] = quantize_kv(k, scales.k)
        v_cache[loc] = quantize_kv(v, scales.v)


def causal_padded_mask(batch: ForwardBatch) -> torch.Tensor:
    """[B, 1, max_extend, max_kv] bool: query i of seq b sees key j iff j <= prefix_b + i < len_b."""
    assert batch.extend_lens is not None
    device = batch.seq_lens.device
    prefix = (batch.seq_lens - batch.extend_lens).view(-1, 1, 1)
    q_pos = prefix + torch.arange(batch.max_extend, device=device).view(1, -1, 1)
    k_pos = torch.arange(batch.max_kv, device=device).view(1, 1, -1)
    mask = (k_pos <= q_pos) & (k_pos < batch.seq_lens.view(-1, 1, 1))
    return mask.unsqueeze(1)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                               page_size: int, scale: float, scales: KVScales | None = None) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]; gathers each sequence's KV through the page table (dequantized with
    `scales` from an FP8 pool)."""
    max_kv = int(seq_lens.max())
    pos = torch.arange(max_kv, device=q.device)
    loc = page_table[slots][:, pos // page_size].long() * page_size + pos % page_size  # [B, max_kv]
    visible = pos.unsqueeze(0) < seq_lens.unsqueeze(1)
    loc = torch.where(visible, loc, 0)
    keys = read_kv(k_cache, loc, q.dtype, None if scales is None else scales.k)  # [B, max_kv, Hkv, D]
    values = read_kv(v_cache, loc, q.dtype, None if scales is None else scales.v)
    out = nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None, :],
        scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return out.squeeze(2)


class PagedAttention(nn.Module):
    """softmax(q k^T * scale) v over each sequence's paged KV; GQA by head grouping."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_index: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.layer_index = layer_index
        self.gqa = num_heads != num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor | None,
                kv_stored: bool = False, qkv: torch.Tensor | None = None, out: torch.Tensor | None = None,
                scales: KVScales | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H*D]. `kv_stored`: a fused kernel already wrote k, v.
        `qkv`: the [T, (H + 2 Hkv) D] projection q, k and v are column views of, if they are. `out`: a
        contiguous [T, H*D] to write and return instead of a new tensor (the paged extend kernels write it,
        the other paths are copied in). `scales`: the layer's, when the pool is FP8."""
        if not kv_stored:
            store_kv(k_cache, v_cache, batch.out_cache_loc, k, v, scales)
        lone_prompt = batch.no_prefix and batch.batch_size == 1 and not batch.is_decode
        if lone_prompt and scales is not None and scales.e4m3_prompts and q.is_cuda:
            from splitserve.engine.layers.e4m3_prompt_attention_triton import e4m3_prompt_attention

            result = e4m3_prompt_attention(q, k_cache, v_cache, batch.out_cache_loc, scales, self.scale,
                                           out=None if out is None else out.view(q.shape))
            return result.view(q.shape[0], -1) if out is None else out
        if lone_prompt and scales is not None:
            # A fresh prompt attends to what its pages hold, as every later step reads them.
            k = read_kv(k_cache, batch.out_cache_loc, q.dtype, scales.k)
            v = read_kv(v_cache, batch.out_cache_loc, q.dtype, scales.v)
            qkv = None
        if batch.is_decode:
            result = self._decode(q, batch, k_cache, v_cache, scales)
        elif batch.no_prefix and batch.batch_size == 1 and batch.prompt_buckets is not None:
            result = lone_prompt_attention(q, k.to(q.dtype), v.to(q.dtype), self.scale, batch.prompt_buckets, qkv)
        elif batch.no_prefix and batch.batch_size == 1:
            result = nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
                v.transpose(0, 1).unsqueeze(0).to(q.dtype), is_causal=True, scale=self.scale, enable_gqa=self.gqa,
            ).squeeze(0).transpose(0, 1)
        elif batch.attn_meta is not None:  # the kernels write `out` itself: no copy
            paged = self._paged_extend(q, batch, k_cache, v_cache, None if out is None else out.view(q.shape),
                                       scales)
            return paged.view(q.shape[0], -1) if out is None else out
        else:
            result = self._extend(q, batch, k_cache, v_cache, mask, scales)
        result = result.reshape(q.shape[0], self.num_heads * self.head_dim)
        return result if out is None else out.copy_(result)

    def decode_new_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, rotary: RotaryEmbedding,
                         scales: KVScales | None = None) -> torch.Tensor:
        """Decode on CUDA from the unrotated projection: the kernel applies RoPE, stores k and v, attends."""
        from splitserve.engine.layers.paged_decode_triton import NewTokenKV, paged_decode_attention, store_rotated_kv

        assert batch.page_table is not None and batch.slots is not None
        new = NewTokenKV(k, v, rotary.cos, rotary.sin, batch.out_cache_loc)
        if batch.rows_share_slots:  # verify rows: each reads the rows before it from the cache
            store_rotated_kv(new, batch.positions, k_cache, v_cache, scales)
        out = paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.slots, batch.seq_lens,
                                     batch.page_size, self.scale, new, splits=batch.decode_splits,
                                     new_kv_stored=batch.rows_share_slots, scales=scales)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scales: KVScales | None = None) -> torch.Tensor:
        assert batch.page_table is not None and batch.slots is not None
        args = (q, k_cache, v_cache, batch.page_table, batch.slots, batch.seq_lens, batch.page_size, self.scale)
        if q.is_cuda:
            from splitserve.engine.layers.paged_decode_triton import paged_decode_attention
            return paged_decode_attention(*args, splits=batch.decode_splits, scales=scales)
        return decode_attention_reference(*args, scales=scales)

    def _paged_extend(self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor | None = None, scales: KVScales | None = None) -> torch.Tensor:
        """Writes the step's attention into `out` [T, H, D] (a new one if None) and returns it."""
        from splitserve.engine.layers.paged_decode_triton import paged_decode_attention
        from splitserve.engine.layers.paged_extend_triton import paged_extend_attention

        assert batch.page_table is not None
        out = q.new_empty(q.shape) if out is None else out
        decode_slots, decode_lens, plan = batch.paged_attention_plan
        n = batch.decode_rows
        if n:
            # One split per row: a mixed step's decode rows come in every count, and each split count
            # would be its own compile; the prompt chunk beside them fills the GPU anyway.
            out[:n] = paged_decode_attention(q[:n], k_cache, v_cache, batch.page_table, decode_slots, decode_lens,
                                             batch.page_size, self.scale, splits=1, scales=scales)
        if batch.prefix_chunks and scales is not None and scales.e4m3_prompts:
            from splitserve.engine.layers.e4m3_prompt_attention_triton import e4m3_prompt_attention

            for c in batch.prefix_chunks:  # the chunk's rows over its prefix's keys and its own
                rows = slice(c.row, c.row + c.length)
                e4m3_prompt_attention(q[rows], k_cache, v_cache,
                                      batch.prefix_chunk_loc[c.loc_start:c.loc_start + c.kv_len], scales, self.scale,
                                      out=out[rows])
        elif batch.prefix_chunks:
            from splitserve.engine.layers.prefix_chunk_attention import prefix_chunk_attention

            keys = read_kv(k_cache, batch.prefix_chunk_loc, q.dtype, None if scales is None else scales.k)
            values = read_kv(v_cache, batch.prefix_chunk_loc, q.dtype, None if scales is None else scales.v)
            for c in batch.prefix_chunks:
                kv = slice(c.loc_start, c.loc_start + c.kv_len)
                prefix_chunk_attention(q, keys[kv], values[kv], c, self.scale, out)
        return paged_extend_attention(q, k_cache, v_cache, batch.page_table, plan, batch.page_size, self.scale, out,
                                      scales=scales)

    def _extend(self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mask: torch.Tensor | None, scales: KVScales | None = None) -> torch.Tensor:
        assert batch.kv_indices is not None and mask is not None
        bsz = batch.batch_size
        keys = read_kv(k_cache, batch.kv_indices, q.dtype, None if scales is None else scales.k)  # [B, max_kv, Hkv, D]
        values = read_kv(v_cache, batch.kv_indices, q.dtype, None if scales is None else scales.v)
        queries = q.new_zeros(bsz, batch.max_extend, self.num_heads, self.head_dim)
        queries[batch.token_batch_index, batch.token_query_index] = q
        out = nn.functional.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=self.scale, enable_gqa=self.gqa,
        )  # [B, H, max_extend, D]
        return out.transpose(1, 2)[batch.token_batch_index, batch.token_query_index]
