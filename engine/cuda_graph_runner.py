"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode step launches hundreds of small kernels; at small batch the GPU would wait on the
CPU launching them. Each bucket's graph is captured once at start-up over its own input
tensor (token ids, positions, slots, one row each); a step fills it with one host-to-device
copy, padding the batch up to the bucket with rows that read and write only the scratch
page, and replays. Everything a decode step does on the device is inside the graph: the
relay merge (a token id of -1 is the slot's token sampled by the step before, still on the
device), the KV locations from the page table, the model, the greedy argmax and the relay
write of that argmax. So a greedy step costs one copy in, one replay and one copy out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from splitserve.engine.forward_batch import ForwardBatch, decode_batch
from splitserve.engine.host_to_device import copy_to_device
from splitserve.engine.sampling.greedy import argmax_tokens

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    chosen = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return [*chosen, max_batch]


class DecodeGraphs:
    """Captured decode graphs, one per bucket; `replay` runs the smallest that fits a batch."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], page_table: torch.Tensor, page_size: int,
                 padding_slot: int, max_batch: int, device: torch.device, relay: torch.Tensor) -> None:
        self.forward = forward
        self.page_table = page_table
        self.page_size = page_size
        self.padding_slot = padding_slot
        self.buckets = buckets_up_to(max_batch)
        self.device = device
        self.relay = relay
        # [3, bucket] int64 per bucket: token ids, positions, slots (padding rows: token 0 at
        # position 0 of the padding slot, whose only page is the scratch page).
        self.inputs = {b: torch.tensor([[0] * b, [0] * b, [padding_slot] * b], dtype=torch.int64, device=device)
                       for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.argmax: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        started = time.monotonic()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bsz in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                    self._step(bsz)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bsz], self.argmax[bsz] = self._step(bsz)
                pool = graph.pool()
                self.graphs[bsz] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), self.buckets[0],
                    self.buckets[-1], time.monotonic() - started)

    def _step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What each graph runs: the whole decode step of a bucket, from its input rows."""
        ids, positions, slots = self.inputs[bucket]
        logits = self.forward(decode_batch(ids, positions, slots, self.page_table, self.page_size, self.relay))
        argmax = argmax_tokens(logits)
        # Greedy rows' next input, for the overlap scheduler; a sampling step overwrites its rows after.
        self.relay[slots] = argmax
        return logits, argmax

    def can_run(self, bsz: int) -> bool:
        return bool(self.graphs) and bsz <= self.buckets[-1]

    def _bucket(self, bsz: int) -> int:
        return next(b for b in self.buckets if b >= bsz)

    def replay(self, ids: list[int], positions: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] and their argmax [B] of a decode step given as host lists (-1 ids: from the relay)."""
        bsz = len(ids)
        bucket = self._bucket(bsz)
        pad = bucket - bsz
        copy_to_device([*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[self.padding_slot] * pad],
                       self.inputs[bucket].view(-1))
        self.graphs[bucket].replay()
        return self.logits[bucket][:bsz], self.argmax[bucket][:bsz]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch already on the device (how tensor-parallel ranks get theirs)."""
        bsz = batch.batch_size
        bucket = self._bucket(bsz)
        inputs = self.inputs[bucket]
        for row, values in enumerate((batch.input_ids, batch.positions, batch.slots)):
            inputs[row, :bsz].copy_(values, non_blocking=True)
        if bucket > bsz:
            inputs[:2, bsz:].zero_()
            inputs[2, bsz:].fill_(self.padding_slot)
        self.graphs[bucket].replay()
        return self.logits[bucket][:bsz]
