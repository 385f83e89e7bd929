"""SwiGLU: silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        from splitserve.engine.layers import fused_triton
        return fused_triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
