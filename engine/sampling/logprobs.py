"""Logprobs of chosen tokens and the top n, from the raw model logits.

As vLLM does by default, these describe the model's own distribution: log-softmax of the logits
before penalties, logit bias, temperature or top-k/top-p/min-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from splitserve.engine.sampling.base import SampleOutput, TopLogprobs
from splitserve.engine.sampling_params import SamplingParams


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at tokens (logits [..., V], tokens [...]); 0.0 where a token is padding (< 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return chosen.masked_fill(tokens < 0, 0.0)


def attach_logprobs(
    output: SampleOutput, logits: torch.Tensor, params: Sequence[SamplingParams]
) -> SampleOutput:
    """output with logprobs and top_logprobs filled in, when any row asked for them.

    logits are the raw logits the tokens were chosen from: [B, V] for sample, [B, K+1, V] for
    verify. Reading the top n back to the host syncs, so it happens only when a row asks.
    """
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return output
    steps = logits.unsqueeze(1) if logits.dim() == 2 else logits  # [B, T, V]
    logprobs = torch.log_softmax(steps.float(), dim=-1)
    tokens = output.tokens.view(steps.shape[0], steps.shape[1])
    chosen = logprobs.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1).masked_fill(tokens < 0, 0.0)

    top_n = max(n for n in wanted if n is not None)
    values: list[list[list[float]]] = []
    ids: list[list[list[int]]] = []
    if top_n > 0:
        top = logprobs.topk(top_n, dim=-1)
        values, ids = top.values.tolist(), top.indices.tolist()
    lengths = output.accept_lengths.tolist()

    rows: list[TopLogprobs | None] = []
    for b, n in enumerate(wanted):
        if n is None:
            rows.append(None)
        elif n == 0:
            rows.append([[] for _ in range(lengths[b])])
        else:
            rows.append([list(zip(ids[b][t][:n], values[b][t][:n], strict=True)) for t in range(lengths[b])])
    return replace(output, logprobs=chosen.view_as(output.tokens), top_logprobs=rows)
