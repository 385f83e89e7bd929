"""Tensor-parallel rank, size and collectives: NCCL on GPUs, gloo on CPU, no-ops at size 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's shard of the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal shard of `total` items; `what` names them in errors."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor-parallel size {self.size}")
        size = total // self.size
        return self.rank * size, size


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> TensorParallel:
    """Joins the process group (NCCL for CUDA, gloo otherwise) and returns this rank's view."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank=rank, size=size)
