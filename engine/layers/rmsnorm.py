"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with an optional fused residual add (returns (normed, new residual))."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None):
        """`residual_out`: where the new residual goes (it may be `residual`: an add in place), else a new tensor."""
        if x.is_cuda:
            from splitserve.engine.layers.fused_triton import add_rmsnorm
            out, new_residual = add_rmsnorm(x, self.weight, self.eps, residual, residual_out)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        residual = torch.add(x, residual, out=residual_out) if residual_out is not None else x + residual
        return self._norm(residual), residual
