"""Paged attention over the KV pool, written in plain torch (the reference path).

New keys and values are written into the pool at each token's slot; every sequence then
attends over its whole KV (cached prefix + new tokens), gathered from its pages, with a
causal mask that is offset by the cached length. One padded SDPA call covers the batch.
"""

from __future__ import annotations

import torch
from splitserve.engine.forward_batch import ForwardBatch
from torch import nn


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def causal_padded_mask(batch: ForwardBatch) -> torch.Tensor:
    """[B, 1, max_extend, max_kv] bool: query i of seq b sees key j iff j <= prefix_b + i < len_b."""
    device = batch.seq_lens.device
    prefix = (batch.seq_lens - batch.extend_lens).view(-1, 1, 1)
    q_pos = prefix + torch.arange(batch.max_extend, device=device).view(1, -1, 1)
    k_pos = torch.arange(batch.max_kv, device=device).view(1, 1, -1)
    mask = (k_pos <= q_pos) & (k_pos < batch.seq_lens.view(-1, 1, 1))
    return mask.unsqueeze(1)


class PagedAttention(nn.Module):
    """softmax(q k^T * scale) v over each sequence's paged KV; GQA by head grouping."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_index: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.layer_index = layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H*D]."""
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        bsz, tokens = batch.batch_size, q.shape[0]
        keys = k_cache[batch.kv_indices].to(q.dtype)  # [B, max_kv, Hkv, D]
        values = v_cache[batch.kv_indices].to(q.dtype)
        queries = q.new_zeros(bsz, batch.max_extend, self.num_heads, self.head_dim)
        queries[batch.token_batch_index, batch.token_query_index] = q
        out = nn.functional.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, max_extend, D]
        out = out.transpose(1, 2)[batch.token_batch_index, batch.token_query_index]
        return out.reshape(tokens, self.num_heads * self.head_dim)
