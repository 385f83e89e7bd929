"""Greedy sampling: the argmax, with no per-request state."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.sampling.base import (
    SampleOutput,
    SamplerBackend,
    SamplingBatch,
    accepted_prefix_length,
    check_sample_inputs,
    check_verify_inputs,
    pad_after,
)
from splitserve.engine.sampling.logprobs import attach_logprobs
from splitserve.engine.sampling_params import SamplingParams


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim (the first index on ties); a parallel Triton reduction on CUDA."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from splitserve.engine.sampling.argmax_triton import argmax_rows

    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    return argmax_rows(flat).view(logits.shape[:-1])


class GreedySampler(SamplerBackend):
    """Takes the argmax of the raw logits; stateless, so reset_slot and commit do nothing.

    verify() accepts each draft token while it equals the argmax at its position, then appends
    the argmax at the first mismatch (or the bonus argmax after all K matched). Draft
    probabilities do not matter to greedy verification and are ignored. Never syncs with the
    device unless a row asks for logprobs.
    """

    def reset_slot(self, slot: int, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        pass

    def commit(self, slots: torch.Tensor, tokens: list[list[int]]) -> None:
        pass

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        check_sample_inputs(logits, batch)
        tokens = argmax_tokens(logits)
        output = SampleOutput(tokens=tokens, accept_lengths=torch.ones_like(tokens))
        return attach_logprobs(output, logits, batch.params)

    def verify(
        self,
        logits: torch.Tensor,
        candidates: torch.Tensor,
        batch: SamplingBatch,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleOutput:
        check_verify_inputs(logits, candidates, batch, draft_probs)
        target = argmax_tokens(logits)  # [B, K+1]
        accept_lengths = accepted_prefix_length(candidates == target[:, :-1]) + 1
        # The accepted candidates equal the argmax, so the output is the argmax row, cut short.
        output = SampleOutput(tokens=pad_after(target, accept_lengths), accept_lengths=accept_lengths)
        return attach_logprobs(output, logits, batch.params)
