"""Sampling backends: one contract (base.py), a stateless greedy backend and a full one."""

from splitserve.engine.sampling.base import SampleOutput, SamplerBackend, SamplingBatch, SamplingShapeError
from splitserve.engine.sampling.full import FullSampler
from splitserve.engine.sampling.greedy import GreedySampler
from splitserve.engine.sampling.select import backend_for

__all__ = [
    "FullSampler",
    "GreedySampler",
    "SampleOutput",
    "SamplerBackend",
    "SamplingBatch",
    "SamplingShapeError",
    "backend_for",
]
