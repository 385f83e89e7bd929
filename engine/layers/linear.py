"""Linear layers split across tensor-parallel ranks, each able to load its shard of a full weight.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and all-reduce the partial sums. Fused projections (q/k/v, gate/up) are one
column-parallel layer whose loader places each checkpoint tensor at its offset.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers import gemm_algos, skinny
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


def _check_shape(name: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> None:
    if expected != actual:
        raise WeightShapeError(f"{name}: expected shape {expected}, checkpoint has {actual}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows (output features) split across ranks.

    `output_sizes` lists the full sizes of the fused sub-projections in order; each rank holds
    its shard of every one of them, so `load(weight, shard_index)` fills one sub-projection.
    """

    skinny_rows = skinny.MAX_ROWS  # 16-bit rows up to this take the row-invariant kernel (a verifier raises it)

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.full_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, "output features")[1] for s in output_sizes]
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False) if bias else None

    def load(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        param = self.bias if loaded.dim() == 1 else self.weight
        if param is None:
            raise WeightShapeError(f"{name}: checkpoint has a bias the config does not ask for")
        full = self.full_sizes[shard_index]
        _check_shape(name, (full, *param.shape[1:]), tuple(loaded.shape))
        local = self.local_sizes[shard_index]
        offset = sum(self.local_sizes[:shard_index])
        param.data[offset:offset + local].copy_(loaded.narrow(0, self.tp.rank * local, local))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` (2-D x's rows by the local output features, contiguous): written and returned instead of a
        new tensor; cuBLAS writes it directly, the other paths are copied in (the same bits either way)."""
        # Decode-sized rows through the row-invariant path too: cuBLAS picks its kernel (and its rounding)
        # by the row count, so a verify step's rows would differ from plain decoding's.
        if skinny.fits(x, self.skinny_rows):
            y = skinny.skinny_linear(x, self.weight, self.bias, self.skinny_rows)
        elif (algo := gemm_algos.lookup(x, self.weight) if self.bias is None else None) is not None:
            y = gemm_algos.lt_linear(x, self.weight, algo)  # a shape the sustained-load sweep found faster
        elif out is None:
            return nn.functional.linear(x, self.weight, self.bias)
        elif self.bias is None:  # F.linear's own cuBLAS call for 2-D rows, into `out`
            return torch.mm(x, self.weight.t(), out=out)
        else:
            return torch.addmm(self.bias, x, self.weight.t(), out=out)
        return y if out is None else out.copy_(y)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's columns (input features) split; partial sums all-reduced."""

    skinny_rows = skinny.MAX_ROWS

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.in_full = in_features
        _, in_local = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        if loaded.dim() == 1:
            if self.bias is None:
                raise WeightShapeError(f"{name}: checkpoint has a bias the config does not ask for")
            _check_shape(name, tuple(self.bias.shape), tuple(loaded.shape))
            self.bias.data.copy_(loaded)
            return
        _check_shape(name, (self.weight.shape[0], self.in_full), tuple(loaded.shape))
        local = self.weight.shape[1]
        self.weight.data.copy_(loaded.narrow(1, self.tp.rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Long K (o_proj, down_proj): at decode sizes cuBLAS splits it and adds a reduction kernel.
        if skinny.fits(x, self.skinny_rows):
            y = skinny.skinny_linear(x, self.weight, max_rows=self.skinny_rows)
        elif (algo := gemm_algos.lookup(x, self.weight)) is not None:
            y = gemm_algos.lt_linear(x, self.weight, algo)
        else:
            y = nn.functional.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias
