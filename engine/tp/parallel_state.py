"""Tensor-parallel rank, size and collectives: NCCL on GPUs, gloo on CPU, no-ops at size 1."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from splitserve.engine.checkpoints.model_config import ModelConfig


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


class TensorParallelSizeError(ValueError):
    """The model cannot be split over the asked-for number of tensor-parallel ranks."""


def check_tp_size(model_cfg: ModelConfig, size: int) -> None:
    """Raises before any process starts if a layer cannot be split evenly over `size` ranks."""
    # KV heads are split, never replicated: a TP size above the KV head count is refused.
    for what, total in (("attention heads", model_cfg.num_heads), ("KV heads", model_cfg.num_kv_heads),
                        ("intermediate size", model_cfg.intermediate_size)):
        if total % size:
            raise TensorParallelSizeError(
                f"--tp-size {size}: the model's {what} ({total}) is not divisible by {size}")


def join_tensor_parallel(rank: int, size: int, store: dist.Store, device: torch.device,
                         timeout: timedelta) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Joins the model's process group and a gloo control group; returns (this rank, control group).

    The model's collectives run on the default group (NCCL on CUDA, gloo on CPU); step messages
    from rank 0 travel on the separate gloo group, which carries pickled objects on any device.
    Every collective fails after `timeout` instead of hanging.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank=rank, size=size), control
