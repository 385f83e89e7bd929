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

    def forward_quantized(self, x: torch.Tensor, residual: torch.Tensor | None, residual_out: torch.Tensor | None,
                          activation: str, input_scale: torch.Tensor | None
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The normed rows as an FP8 layer's e4m3 input and [M, 1] scales, with the new residual (`x` itself
        where `residual` is None), in one CUDA kernel: the bits of forward then quantizing its rows."""
        from splitserve.engine.quantization.fp8_cuda import fits_one_pass, quantize_rows, rmsnorm_quantize

        if not fits_one_pass(x.shape[-1]):  # too wide for one program's registers: two kernels
            out = self.forward(x, residual, residual_out)
            normed, new = out if residual is not None else (out, x)
            return quantize_rows(normed, activation, input_scale), new
        q, s, new_residual = rmsnorm_quantize(x, self.weight, self.eps, residual, residual_out, activation,
                                              input_scale)
        return (q, s), (x if new_residual is None else new_residual)
