"""Token bitmasks (xgrammar's layout: int32 words, bit i of word w allows token 32 * w + i)
applied to logits with plain tensor ops, so a GPU applies them with no host sync."""

from __future__ import annotations

import torch

BITS = 32


def words_for(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., vocab_size] from int32 bitmask [..., words]."""
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with -inf at every token the bitmask [..., words] forbids (a new tensor)."""
    return logits.masked_fill(~allowed_mask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1]),
                              float("-inf"))


def bitmask_of(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """int32 [words] allowing exactly `token_ids`."""
    allowed = torch.zeros(words_for(vocab_size) * BITS, dtype=torch.bool)
    allowed[token_ids] = True
    weights = torch.tensor([1 << i for i in range(BITS - 1)] + [-(1 << (BITS - 1))], dtype=torch.int64)
    return (allowed.view(-1, BITS).long() * weights).sum(-1).to(torch.int32)
