"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode step launches hundreds of small kernels; at small batch the GPU would wait on the
CPU launching them. Each bucket's graph is captured once at start-up over its own input
tensor (token ids, positions, slots, one row each); a step fills it with one host-to-device
copy, padding the batch up to the bucket with rows that read and write only the scratch
page, and replays. Everything a decode step does on the device is inside the graph: the
relay merge (a token id of -1 is the slot's token sampled by the step before, still on the
device), the KV locations from the page table, the model, the greedy argmax and the relay
write of that argmax. So a greedy step costs one copy in, one replay and one copy out. The
graph keeps the logits as its `forward` returns them: plain decode graphs take the model's dtype
(the argmax of bfloat16 logits is the argmax of their float32 copy) and a sampling step casts
after the replay, so greedy steps never write the float32 copy.

Verify steps (speculative decoding) have graphs of their own: `rows_per_request` R = K+1 rows per request
(a request's last token and its drafts, each a decode row at its own position; requests with
fewer drafts pad with scratch rows), one graph per bucket of requests and per R. Their rows attend
with the split count plain decoding of that bucket uses (in batch-invariant mode, one count for
every bucket: engine/layers/decode_splits.py), so each row's logits are the ones a plain decode step
would compute at that position. Verification itself runs after the replay.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from splitserve.engine.runner.forward_batch import ForwardBatch, decode_batch
from splitserve.engine.runner.host_to_device import copy_to_device
from splitserve.engine.sampling.greedy import argmax_tokens

logger = logging.getLogger(__name__)

K = TypeVar("K")
T = TypeVar("T")

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch: int) -> list[int]:
    chosen = [b for b in DEFAULT_BUCKETS if b < max_batch]
    return [*chosen, max_batch]


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture of the process runs on. cuBLAS gets a workspace per stream it runs on, and
    torch keeps each for the process's life; a new stream per capture (decode, verify, lone-prompt and piecewise
    graphs, again for every engine built in the process) left one more workspace behind each time, so a stopped
    engine did not give all its memory back."""
    return torch.cuda.Stream(device)


def capture_graphs(keys: list[K], step: Callable[[K], T], device: torch.device, pool: tuple | None = None
                   ) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, T], tuple | None]:
    """One CUDA graph of `step(key)` per key, captured in that order on a side stream into one memory pool
    (`pool`, or the first graph's): each key's step runs twice first, outside the capture (Triton compiles,
    cuBLAS picks its kernels, cuDNN builds its graph), and every graph is replayed once at the end, since a
    graph's first replay costs more than later ones and a request's step should not pay it (on the H200 an 8B
    verifier's first verify step of a run took 29 ms on the device, the next ones 4.5-7). Returns the graphs,
    each one's outputs (the tensors its replays write) and the pool."""
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outputs: dict[K, T] = {}
    stream = capture_stream(torch.device(device.type, device.index if device.index is not None
                                         else torch.cuda.current_device()))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for key in keys:
            for _ in range(2):
                step(key)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[key] = step(key)
            pool = graph.pool()
            graphs[key] = graph
        for graph in graphs.values():
            graph.replay()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs, outputs, pool


class DecodeGraphs:
    """Captured decode graphs, one per bucket; `replay` runs the smallest that fits a batch."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], page_table: torch.Tensor, page_size: int,
                 padding_slot: int, max_batch: int, device: torch.device, relay: torch.Tensor,
                 rows_per_request: int = 1, decode_splits: Callable[[int, int], int | None] | None = None,
                 rope_offsets: bool = False) -> None:
        """`rows_per_request` > 1: verify graphs (see the module docstring); `decode_splits(bucket, rows)`:
        the paged decode kernel's split count for a bucket of requests in `rows` rows (None: the kernel's
        default for the rows); `rope_offsets`: a fourth input row, each row's M-RoPE offset (Qwen-VL)."""
        self.forward = forward
        self.rows_per_request = rows_per_request
        self.decode_splits = decode_splits
        self.page_table = page_table
        self.page_size = page_size
        self.padding_slot = padding_slot
        self.buckets = buckets_up_to(max_batch)
        self.device = device
        self.relay = relay
        self.rope_offsets = rope_offsets
        # [3, bucket] int64 per bucket: token ids, positions, slots (padding rows: token 0 at
        # position 0 of the padding slot, whose only page is the scratch page); then the M-RoPE offsets.
        fill = [0, 0, padding_slot, 0][:4 if rope_offsets else 3]
        self.inputs = {b: torch.tensor([[v] * b * rows_per_request for v in fill], dtype=torch.int64, device=device)
                       for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.argmax: dict[int, torch.Tensor] = {}

    def capture(self, pool: tuple | None = None) -> tuple | None:
        """Captures every bucket's graph (in `pool`, a graph memory pool to share); returns the pool."""
        started = time.monotonic()
        # Largest first, so smaller graphs reuse its memory pool.
        self.graphs, outputs, pool = capture_graphs(list(reversed(self.buckets)), self._step, self.device, pool)
        for bsz, (logits, argmax) in outputs.items():
            self.logits[bsz], self.argmax[bsz] = logits, argmax
        kind = "decode" if self.rows_per_request == 1 else f"verify ({self.rows_per_request} rows per request)"
        logger.info("captured %d %s CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), kind, self.buckets[0],
                    self.buckets[-1], time.monotonic() - started)
        return pool

    def _step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What each graph runs: the whole decode step of a bucket, from its input rows."""
        ids, positions, slots = self.inputs[bucket][:3]
        offsets = self.inputs[bucket][3] if self.rope_offsets else None
        verify = self.rows_per_request > 1
        splits = self.decode_splits(bucket, bucket * self.rows_per_request) if self.decode_splits else None
        logits = self.forward(decode_batch(ids, positions, slots, self.page_table, self.page_size, self.relay,
                                           rows_share_slots=verify, decode_splits=splits, rope_offsets=offsets))
        argmax = argmax_tokens(logits)
        if not verify:  # a verify step's next input is known only once its drafts are verified
            # Greedy rows' next input, for the overlap scheduler; a sampling step overwrites its rows after.
            self.relay[slots] = argmax
        return logits, argmax

    def can_run(self, bsz: int) -> bool:
        return bool(self.graphs) and bsz <= self.buckets[-1]

    def _bucket(self, bsz: int) -> int:
        return next(b for b in self.buckets if b >= bsz)

    def replay(self, ids: list[int], positions: list[int], slots: list[int], offsets: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B*R, V] (in the dtype the graph's forward gave them) and their argmax [B*R] of a step
        given as host lists of R rows per request (-1 ids: from the relay); `offsets`: M-RoPE graphs' rows'."""
        rows = len(ids)
        bucket = self._bucket(rows // self.rows_per_request)
        pad = bucket * self.rows_per_request - rows
        values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[self.padding_slot] * pad]
        if self.rope_offsets:
            values += [*(offsets or [0] * rows), *[0] * pad]
        copy_to_device(values, self.inputs[bucket].view(-1))
        self.graphs[bucket].replay()
        return self.logits[bucket][:rows], self.argmax[bucket][:rows]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, V] of a decode batch already on the device (how tensor-parallel ranks get theirs)."""
        bsz = batch.batch_size
        bucket = self._bucket(bsz)
        inputs = self.inputs[bucket]
        for row, values in enumerate((batch.input_ids, batch.positions, batch.slots)):
            inputs[row, :bsz].copy_(values, non_blocking=True)
        if self.rope_offsets:
            if batch.rope_offsets is None:
                inputs[3, :bsz].zero_()
            else:
                inputs[3, :bsz].copy_(batch.rope_offsets, non_blocking=True)
        if bucket > bsz:
            inputs[:2, bsz:].zero_()
            inputs[2, bsz:].fill_(self.padding_slot)
            inputs[3:, bsz:].zero_()
        self.graphs[bucket].replay()
        return self.logits[bucket][:bsz].float()
