"""The tensors one forward pass needs: flattened tokens plus where each sequence's KV lives.

Two shapes of batch: an *extend* batch (any mix of prompt chunks and decodes; every KV
location is precomputed) and a *decode* batch (one new token per sequence; KV locations are
derived on the device from the page table, so the same tensors can be replayed by a CUDA
graph with nothing but the token ids, positions and slots changing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from splitserve.engine.layers.extend_plan import ExtendPlan, PrefixChunk, aligned, extend_plan_from


@dataclass
class ForwardBatch:
    """A batch of sequences, each running `extend_lens[b]` new tokens on top of its cached KV.

    Tokens of all sequences are flattened into one dimension of length T.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV pool token slot each new token's KV goes to
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    logits_index: torch.Tensor  # [S] int64, flat index of the tokens whose logits are wanted
    # Extend batches: where every sequence's KV is, and how queries map to sequences.
    extend_lens: torch.Tensor | None = None  # [B] int64, new tokens this step
    kv_indices: torch.Tensor | None = None  # [B, max_kv] int64, pool token slot of each position (padded)
    token_batch_index: torch.Tensor | None = None  # [T] int64, which sequence each token belongs to
    token_query_index: torch.Tensor | None = None  # [T] int64, index of each token among its sequence's new ones
    max_extend: int = 1
    max_kv: int = 0
    no_prefix: bool = False  # no sequence has cached KV before this step (a plain causal prefill)
    # CUDA: a lone fresh prompt attends through cuDNN at the bucket lengths up to this many tokens, whose
    # graphs the warm-up built, through flash attention past them up to 4,096 tokens (0: no bucket), and past
    # 4,096 through cuDNN at coarse buckets built on first use (prompt_attention.py); None: SDPA's default
    # dispatch (the CPU, a runner before its warm-up).
    prompt_buckets: int | None = None
    # Extend batches on CUDA: the paged kernels' plan instead of kv_indices (see paged_attention_plan).
    attn_meta: torch.Tensor | None = None  # int32: decode rows' slots and KV lengths, then an ExtendPlan
    decode_rows: int = 0  # the leading one-token chunks, which run through the paged decode kernel
    extend_chunks: int = 0
    extend_blocks: int = 0
    # Full prompt chunks after whole chunks, which attend through cuDNN instead (not in the plan), and
    # the KV pool locations of each one's positions 0..kv_len, one after another.
    prefix_chunks: tuple[PrefixChunk, ...] = ()
    prefix_chunk_loc: torch.Tensor | None = None  # int64
    # Decode batches: the page table and each sequence's row in it.
    slots: torch.Tensor | None = None  # [B] int64
    page_table: torch.Tensor | None = None  # [max_slots, max_pages] int32
    page_size: int = 0
    # Verify steps run as decode batches of several rows per sequence (a request's K+1 positions):
    # each row's KV is stored before any row attends (see PagedAttention.decode_new_token).
    rows_share_slots: bool = False
    # Splits per row of the paged decode kernel (None: its default for the batch's rows). A verify
    # batch passes the count plain decoding of its requests uses, so its rows attend with the same numerics.
    decode_splits: int | None = None
    # A multimodal prompt's image rows and the flat token positions they replace (None: text only).
    # Rows, not whole embeddings: every tensor-parallel rank embeds the ids itself (the embedding's
    # all-reduce pairs up across ranks) and writes the rows over them; the rows travel with the batch.
    image_rows: torch.Tensor | None = None  # [N, hidden]
    image_positions: torch.Tensor | None = None  # [N] int64
    # M-RoPE (Qwen2-VL): each token's (t, h, w) rotary positions when a request's differ from `positions` (its
    # image tokens and everything after them); None: the rotary positions are `positions`.
    rope_positions: torch.Tensor | None = None  # [3, T] int64
    # M-RoPE decode rows (a token past a request's last image: its three positions equal): each rotates at
    # position + offset (the request's delta; 0 for text-only requests). A decode graph takes it as an input row.
    rope_offsets: torch.Tensor | None = None  # [T] int64

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.slots is not None

    @functools.cached_property
    def paged_attention_plan(self) -> tuple[torch.Tensor, torch.Tensor, ExtendPlan]:
        """The decode rows' slots and KV lengths, and the plan of the other chunks (CUDA extend batches)."""
        assert self.attn_meta is not None
        n, a = self.decode_rows, aligned(self.decode_rows)
        plan = extend_plan_from(self.attn_meta[2 * a:], self.extend_chunks, self.extend_blocks)
        return self.attn_meta[:n], self.attn_meta[a:a + n], plan


def kv_token_locations(page_table: torch.Tensor, slots: torch.Tensor | int, positions: torch.Tensor,
                       page_size: int) -> torch.Tensor:
    """[T] int64: the KV pool location of each token, at `positions` of the sequence in `slots` (one slot per
    token, or one for all), read from the page table (on the device: inside a CUDA graph too)."""
    return page_table[slots, positions // page_size].long() * page_size + positions % page_size


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                 page_size: int, relay: torch.Tensor | None = None, rows_share_slots: bool = False,
                 decode_splits: int | None = None, rope_offsets: torch.Tensor | None = None) -> ForwardBatch:
    """A decode batch whose KV locations are computed on the device (CUDA-graph friendly).

    Token ids of -1 are taken from `relay[slot]`, the device buffer of each slot's latest token.
    `rows_share_slots`: several rows are positions of one sequence (a verify step).
    """
    if input_ids.is_cuda:  # one kernel for what is ten small ones in torch (every decode step runs it)
        from splitserve.engine.layers.fused_triton import decode_inputs
        input_ids, out_cache_loc, seq_lens, logits_index = decode_inputs(input_ids, positions, slots, page_table,
                                                                         page_size, relay)
    else:
        if relay is not None:
            input_ids = torch.where(input_ids >= 0, input_ids, relay[slots])
        out_cache_loc, seq_lens = kv_token_locations(page_table, slots, positions, page_size), positions + 1
        logits_index = torch.arange(input_ids.shape[0], device=input_ids.device)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, seq_lens=seq_lens,
        logits_index=logits_index, slots=slots, page_table=page_table, page_size=page_size,
        rows_share_slots=rows_share_slots, decode_splits=decode_splits, rope_offsets=rope_offsets,
    )
