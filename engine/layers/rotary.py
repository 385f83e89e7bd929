"""Rotary position embedding (GPT-NeoX half-split layout, as Llama checkpoints use) with scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, adjusted by `linear` or `llama3` scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"rope scaling type {kind!r} not supported")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at given positions from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, D], k: [T, kv_heads, D]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): the frequency pairs split into `sections` taking a token's t, h and w positions in turn.

    Positions are [T] (each token's three are equal: plain RoPE) or [3, T] (a multimodal prompt's)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, sections: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, theta, None)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope sections {sections} must sum to half the head size {head_dim // 2}")
        # Which of (t, h, w) each frequency pair reads.
        axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        pair = torch.arange(self.axis.shape[0], device=positions.device)
        rows = positions[self.axis].T  # [T, pairs]: the position each pair of each token rotates by
        cos = self.cos[rows, pair].unsqueeze(1)
        sin = self.sin[rows, pair].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
