"""Which backend a batch needs."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.sampling.base import SamplerBackend
from splitserve.engine.sampling_params import SamplingParams


def backend_for(
    params: Sequence[SamplingParams], greedy: SamplerBackend, full: SamplerBackend
) -> SamplerBackend:
    """greedy when every row takes the argmax of unmodified logits, else full.

    Both backends report logprobs the same way (from the raw logits), so logprobs do not force
    the full backend. Call reset_slot and commit on the full backend for every request whatever
    this returns: its per-slot state must stay complete for the batches that do need it.
    """
    return greedy if all(p.is_greedy for p in params) else full
