"""The contract every sampling backend keeps: what goes in, what comes out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.sampling_params import SamplingParams

# Per output token of one row: the top n (token id, logprob) pairs, most likely first.
TopLogprobs = list[list[tuple[int, float]]]

PAD_TOKEN = -1  # fills a verify row after its accepted length


class SamplingShapeError(ValueError):
    """Logits, candidates or draft probabilities do not have the shapes the batch implies."""


@dataclass
class SamplingBatch:
    """The rows being sampled: each row's pool slot and its request's parameters.

    `params[i]` must be the parameters `reset_slot` was given for `slots[i]`: backends read
    per-slot state on the device and use `params` only for host-side decisions (which work a
    batch needs, which rows are seeded or want logprobs).
    """

    slots: torch.Tensor  # int64 [B]
    params: list[SamplingParams]
    host_slots: list[int] | None = None  # the same slots on the host, when the caller has them (no device sync)

    def __post_init__(self) -> None:
        if self.slots.dim() != 1 or self.slots.shape[0] != len(self.params):
            raise SamplingShapeError(
                f"slots has shape {tuple(self.slots.shape)} but there are {len(self.params)} params"
            )

    def __len__(self) -> int:
        return len(self.params)

    def slot_list(self) -> list[int]:
        return self.host_slots if self.host_slots is not None else self.slots.tolist()


@dataclass
class SampleOutput:
    """What sample() and verify() return.

    tokens: int64, [B] from sample(); [B, K+1] from verify(), -1 after each row's accepted length.
    accept_lengths: int64 [B], how many output tokens each row has (sample: 1; verify: accepted
        draft tokens plus the correction or bonus token, so >= 1).
    logprobs: float32 like tokens, log-softmax of the raw logits at the chosen tokens (0.0 at
        padding), or None when no row asked for logprobs.
    top_logprobs: per row, None when that row did not ask, else per output token the top n
        (token id, logprob) pairs; None when no row asked.
    """

    tokens: torch.Tensor
    accept_lengths: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: list[TopLogprobs | None] | None = None


class SamplerBackend(ABC):
    """Chooses next tokens from logits; may keep per-request state indexed by pool slot."""

    @abstractmethod
    def reset_slot(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        """A new request takes `slot`: forget the previous one's state and set up this one's."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """One token per row from float32 logits [B, V]."""

    @abstractmethod
    def verify(
        self,
        logits: torch.Tensor,
        candidates: torch.Tensor,
        batch: SamplingBatch,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Checks K draft tokens per row against the target logits [B, K+1, V].

        candidates: int64 [B, K]; draft_probs: [B, K, V], the draft's distribution at each
        position, or None for a deterministic draft. Returns the accepted prefix followed by
        one token from the target (the correction at the first rejection, or the bonus token
        after all K were accepted).
        """

    @abstractmethod
    def commit(self, slots: torch.Tensor, tokens: list[list[int]]) -> None:
        """Records the tokens each slot actually emitted (after verify: the accepted ones)."""


def check_sample_inputs(logits: torch.Tensor, batch: SamplingBatch, vocab_size: int | None = None) -> None:
    """Raises SamplingShapeError unless logits is [B, V] for this batch (V == vocab_size if given)."""
    if logits.dim() != 2 or logits.shape[0] != len(batch):
        raise SamplingShapeError(f"logits has shape {tuple(logits.shape)}, expected [{len(batch)}, V]")
    if vocab_size is not None and logits.shape[1] != vocab_size:
        raise SamplingShapeError(f"logits has {logits.shape[1]} columns, the sampler's vocab is {vocab_size}")


def check_verify_inputs(
    logits: torch.Tensor,
    candidates: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None,
    vocab_size: int | None = None,
) -> None:
    """Raises SamplingShapeError unless logits [B, K+1, V], candidates [B, K], draft_probs [B, K, V]."""
    b = len(batch)
    if candidates.dim() != 2 or candidates.shape[0] != b:
        raise SamplingShapeError(f"candidates has shape {tuple(candidates.shape)}, expected [{b}, K]")
    k = candidates.shape[1]
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, k + 1):
        raise SamplingShapeError(f"logits has shape {tuple(logits.shape)}, expected [{b}, {k + 1}, V]")
    v = logits.shape[2]
    if vocab_size is not None and v != vocab_size:
        raise SamplingShapeError(f"logits has {v} columns, the sampler's vocab is {vocab_size}")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, v):
        raise SamplingShapeError(
            f"draft_probs has shape {tuple(draft_probs.shape)}, expected [{b}, {k}, {v}]"
        )


def accepted_prefix_length(accepted: torch.Tensor) -> torch.Tensor:
    """[B, K] bool of per-position acceptance -> int64 [B], the length of each row's all-True prefix."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def pad_after(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] with every position at or past lengths[b] replaced by PAD_TOKEN."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions >= lengths.unsqueeze(1), PAD_TOKEN)
