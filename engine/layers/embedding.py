"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks; a multimodal
prompt's image rows written over the token embeddings."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers import gemm_algos, skinny
from splitserve.engine.layers.linear import WeightShapeError
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; out-of-slice ids contribute zero."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad the vocabulary up to a multiple of the TP size; padded rows are never selected.
        self.local_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        expected = (self.vocab_size, self.weight.shape[1])
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(f"{name}: expected shape {expected}, checkpoint has {tuple(loaded.shape)}")
        end = min(self.vocab_start + self.local_vocab, self.vocab_size)
        self.weight.data[: end - self.vocab_start].copy_(loaded[self.vocab_start:end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (each rank computes its slice, then gathers)."""

    skinny_rows = skinny.MAX_ROWS

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if skinny.fits(hidden, self.skinny_rows):
            logits = skinny.skinny_linear(hidden, self.weight, max_rows=self.skinny_rows)
        elif (algo := gemm_algos.lookup(hidden, self.weight)) is not None:
            logits = gemm_algos.lt_linear(hidden, self.weight, algo)
        else:
            logits = nn.functional.linear(hidden, self.weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]


def with_image_rows(token_embeds: torch.Tensor, rows: torch.Tensor | None,
                    positions: torch.Tensor | None) -> torch.Tensor:
    """The flat [T, hidden] token embeddings with a multimodal prompt's image rows written over their
    positions (every tensor-parallel rank does it after the embedding's all-reduce)."""
    if rows is None or positions is None:
        return token_embeds
    return token_embeds.index_copy(0, positions, rows.to(token_embeds.dtype))
