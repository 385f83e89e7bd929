"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode step launches hundreds of small kernels; at small batch the GPU would wait on the
CPU launching them. Each bucket's graph is captured once at start-up over static input
buffers (token ids, positions, slots); a step copies its inputs in, pads the batch up to the
bucket with rows that read and write only the scratch page, and replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from splitserve.engine.forward_batch import ForwardBatch, decode_batch

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    chosen = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return [*chosen, max_batch]


class DecodeGraphs:
    """Captured decode graphs over shared static buffers; `run` replays the smallest that fits."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], page_table: torch.Tensor, page_size: int,
                 padding_slot: int, max_batch: int, device: torch.device, relay: torch.Tensor | None = None) -> None:
        self.forward = forward
        self.page_table = page_table
        self.page_size = page_size
        self.padding_slot = padding_slot
        self.buckets = buckets_up_to(max_batch)
        self.device = device
        self.relay = relay
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), padding_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        started = time.monotonic()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bsz in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
                batch = self._static_batch(bsz)
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                    self.forward(batch)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(self._static_batch(bsz))
                pool = graph.pool()
                self.graphs[bsz], self.outputs[bsz] = graph, out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), self.buckets[0],
                    self.buckets[-1], time.monotonic() - started)

    def _static_batch(self, bsz: int) -> ForwardBatch:
        return decode_batch(self.input_ids[:bsz], self.positions[:bsz], self.slots[:bsz], self.page_table,
                            self.page_size, self.relay)

    def can_run(self, bsz: int) -> bool:
        return bool(self.graphs) and bsz <= self.buckets[-1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch, by replaying the bucket's graph."""
        bsz = batch.batch_size
        bucket = next(b for b in self.buckets if b >= bsz)
        self.input_ids[:bsz].copy_(batch.input_ids, non_blocking=True)  # already merged with the relay
        self.positions[:bsz].copy_(batch.positions, non_blocking=True)
        self.slots[:bsz].copy_(batch.slots, non_blocking=True)
        if bucket > bsz:  # padded rows: position 0 of the padding slot, whose page is the scratch page
            self.input_ids[bsz:bucket].zero_()
            self.positions[bsz:bucket].zero_()
            self.slots[bsz:bucket].fill_(self.padding_slot)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bsz]
