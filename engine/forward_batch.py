"""The tensors one forward pass needs: flattened tokens plus where each sequence's KV lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A batch of sequences, each running `extend_lens[b]` new tokens on top of its cached KV.

    Tokens of all sequences are flattened into one dimension of length T. A decode step is
    the case where every extend length is 1.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV pool token slot each new token's KV goes to
    seq_lens: torch.Tensor  # [B] int64, KV length after this step
    extend_lens: torch.Tensor  # [B] int64, new tokens this step
    kv_indices: torch.Tensor  # [B, max_kv] int64, pool token slot of each position (padded)
    token_batch_index: torch.Tensor  # [T] int64, which sequence each token belongs to
    token_query_index: torch.Tensor  # [T] int64, index of each token among its sequence's new ones
    logits_index: torch.Tensor  # [S] int64, flat index of the tokens whose logits are wanted
    max_extend: int
    max_kv: int

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.max_extend == 1
