"""Rank 0 tells the other tensor-parallel ranks what to run: one message per engine step.

A message is a kind ("step", "poll", "ops", "ping" or "stop"), its payload, and the role
operations queued since the last message (a prefill/decode role's transfer calls, which every
rank repeats on its own KV; see engine/roles/replicated_transfers.py). Workers apply the
operations before acting on the message. For a step the payload is the `ForwardBatch`. The batch is
split in two: its device tensors (on a GPU) travel on the model's process group (NCCL), so rank 0
never copies them back to the host; everything else (ints, and every tensor on a CPU run) travels
pickled in a small header on the gloo control group. Workers rebuild the same `ForwardBatch` on
their own device and run the same forward pass, so their collectives pair up with rank 0's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

STEP, POLL, OPS, PING, STOP = "step", "poll", "ops", "ping", "stop"


@dataclass(frozen=True)
class DeviceTensorSpec:
    """Where one device tensor of the batch sits in the flat buffer of its dtype."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


@dataclass
class StepMessage:
    """What a worker received: its kind, the role operations to apply first, and the payload
    (for a step, the batch rebuilt on the worker's device)."""

    kind: str
    ops: list[Any]
    batch: ForwardBatch | None = None
    payload: Any = None


def _batch_fields(batch: ForwardBatch) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}


class StepBroadcaster:
    """Rank 0's sending side; the ModelRunner calls `broadcast(batch)` before every forward pass."""

    def __init__(self, control: dist.ProcessGroup) -> None:
        self.control = control
        self.last_sent = time.monotonic()
        self.pending_ops: list[Any] = []

    def queue_op(self, op: Any) -> None:
        """Queues a role operation; it travels with the next message of any kind."""
        self.pending_ops.append(op)

    def send_ops(self) -> None:
        """Sends the queued operations now, if any (the engine loop calls this every iteration)."""
        if self.pending_ops:
            self._send(OPS, None)

    def poll(self, payload: Any) -> None:
        """Asks the workers to poll their transfers for `payload` (then all ranks agree on a MIN)."""
        self._send(POLL, payload)

    def broadcast(self, batch: ForwardBatch) -> None:
        header: dict[str, Any] = {}
        specs: list[DeviceTensorSpec] = []
        flat: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}
        for name, value in _batch_fields(batch).items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                offset = sizes.get(value.dtype, 0)
                specs.append(DeviceTensorSpec(name, value.dtype, tuple(value.shape), offset))
                flat.setdefault(value.dtype, []).append(value.reshape(-1))
                sizes[value.dtype] = offset + value.numel()
            else:
                header[name] = value
        self._send(STEP, (header, specs, sizes))
        for dtype in sizes:  # dicts keep insertion order: workers see the same dtype order
            dist.broadcast(torch.cat(flat[dtype]), src=0)

    def ping(self) -> None:
        """Keeps idle workers' receive from timing out (every collective has a timeout)."""
        self._send(PING, None)

    def stop(self) -> None:
        self._send(STOP, None)

    def _send(self, kind: str, payload: Any) -> None:
        ops, self.pending_ops = self.pending_ops, []
        dist.broadcast_object_list([(kind, payload, ops)], src=0, group=self.control)
        self.last_sent = time.monotonic()


def receive_step(control: dist.ProcessGroup, device: torch.device,
                 persistent: dict[str, torch.Tensor] | None = None) -> StepMessage:
    """A worker's receiving side: blocks until rank 0 sends the next message.

    A field named in `persistent` is copied into that tensor, which the batch then carries: a
    worker's CUDA graphs were captured over its own page table, so the table must be updated in
    place rather than replaced.
    """
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    kind, payload, ops = box[0]
    if kind != STEP:
        return StepMessage(kind, ops, payload=payload)
    header, specs, sizes = payload
    buffers = {}
    for dtype, numel in sizes.items():
        buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(buffers[dtype], src=0)
    fields = dict(header)
    for spec in specs:
        numel = 1
        for d in spec.shape:
            numel *= d
        fields[spec.name] = buffers[spec.dtype][spec.offset:spec.offset + numel].view(spec.shape)
    for name, target in (persistent or {}).items():
        if fields.get(name) is not None:
            fields[name] = target.copy_(fields[name])
    return StepMessage(STEP, ops, ForwardBatch(**fields))
