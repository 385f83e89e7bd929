"""Tensor parallelism: the rank-0 supervisor, the workers, the collectives and the per-step broadcast."""
