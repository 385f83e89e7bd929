"""CUDA graphs for a lone fresh prompt: one graph per bucket length, the prompt padded at the end.

A step that prefills one prompt of a few hundred tokens, with nothing cached before it, is the step an idle
server runs for each new request (and a drafter for each request it syncs). Eagerly it launches ~15 kernels a
layer, and on the H200's host those launches take longer than the kernels: an 8B forward of 512 tokens took
19.6 ms against 10.5 ms of kernels, 256 tokens 16.2 against 6.5 (benchmarks/prefill_host_share.py). Past
~1,024 tokens the kernels take longer than their launches (1.10x at 1,024, 1.07x at 2,048) and a graph has
nothing to hide.

So a prompt of n <= `max_tokens` tokens runs the graph of the next multiple of BUCKET_STEP, L: its rows are
the prompt's n tokens, then L - n padding rows (token 0 at position 0 of the padding slot, whose page-table
row is all scratch page: their KV lands there). Every layer works row by row except attention, which is
causal: a real row never attends to a padding row after it, so the real rows are those of an L-row prompt's
first n rows, and the logits row is n - 1. Attention inside the graph is the lone prompt's cuDNN call at L,
the bucket the warm-up built (engine/layers/prompt_attention.py), with no padding of its own to add. The
projections run at L rows rather than n, so their rounding is that of an L-row GEMM: the same for every run
of the engine, and for a unified engine and a prefill pod alike, but not bit for bit an n-row forward's. With
--disable-cuda-graph the same padded batches run eagerly, so an engine gives the same tokens with and without
graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from splitserve.engine.layers.prompt_attention import bucket_lengths, prompt_bucket
from splitserve.engine.runner.decode_graphs import capture_graphs
from splitserve.engine.runner.forward_batch import ForwardBatch, kv_token_locations
from splitserve.engine.runner.host_to_device import copy_to_device

logger = logging.getLogger(__name__)


def prompt_batch(inputs: torch.Tensor, bucket: int, page_table: torch.Tensor, page_size: int,
                 prompt_buckets: int, constants: dict[str, torch.Tensor]) -> ForwardBatch:
    """The batch a bucket's graph runs, over its input tensor (`inputs`: [3 * bucket + 1] int64: token ids,
    positions, slots, then the logits row); the KV locations are computed here, on the device (inside the
    graph: each replay's from its own inputs); `constants`: prompt_constants(bucket), made before any capture."""
    ids, positions, slots = inputs[:3 * bucket].view(3, bucket)
    return ForwardBatch(input_ids=ids, positions=positions,
                        out_cache_loc=kv_token_locations(page_table, slots, positions, page_size),
                        logits_index=inputs[3 * bucket:], max_extend=bucket, max_kv=bucket, no_prefix=True,
                        prompt_buckets=prompt_buckets, **constants)


def prompt_constants(bucket: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The fields of a bucket's batch that every prompt shares: one sequence of `bucket` new tokens."""
    return {"seq_lens": torch.tensor([bucket], dtype=torch.int64, device=device),
            "extend_lens": torch.tensor([bucket], dtype=torch.int64, device=device),
            "token_batch_index": torch.zeros(bucket, dtype=torch.int64, device=device),
            "token_query_index": torch.arange(bucket, device=device)}


class PromptGraphs:
    """Captured lone-prompt graphs, one per bucket length; `run` replays the smallest that fits a prompt."""

    def __init__(self, logits: Callable[[ForwardBatch], torch.Tensor], page_table: torch.Tensor, page_size: int,
                 padding_slot: int, max_tokens: int, prompt_buckets: int, device: torch.device) -> None:
        """`logits`: the model's logits of a batch's logits rows; `max_tokens`: the longest prompt a graph
        runs; `prompt_buckets`: the cuDNN buckets the warm-up built (every graph length must be one)."""
        self.lengths = bucket_lengths(min(max_tokens, prompt_buckets))  # the attention's buckets, as far as both go
        self.longest = self.lengths[-1] if self.lengths else 0
        self.padding_slot = padding_slot
        self.device = device
        self.inputs = {n: torch.tensor([0] * n + [0] * n + [padding_slot] * n + [0], dtype=torch.int64,
                                       device=device) for n in self.lengths}
        self.constants = {n: prompt_constants(n, device) for n in self.lengths}
        self.page_table = page_table
        self.page_size = page_size
        self.prompt_buckets = prompt_buckets
        self.logits_fn = logits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def capture(self, pool: tuple | None = None) -> tuple | None:
        """Captures every bucket's graph, largest first (the smaller ones reuse its memory); returns the pool."""
        started = time.monotonic()
        self.graphs, self.logits, pool = capture_graphs(list(reversed(self.lengths)), self._logits, self.device, pool)
        if self.lengths:
            logger.info("captured %d lone-prompt CUDA graphs (%d..%d tokens) in %.1f s", len(self.graphs),
                        self.lengths[0], self.lengths[-1], time.monotonic() - started)
        return pool

    def _logits(self, bucket: int) -> torch.Tensor:
        """What each graph runs: the bucket's batch from its inputs, through the model."""
        return self.logits_fn(prompt_batch(self.inputs[bucket], bucket, self.page_table, self.page_size,
                                           self.prompt_buckets, self.constants[bucket]))

    def bucket(self, tokens: int) -> int | None:
        """The length of the graph a lone prompt of `tokens` tokens runs in; None: longer than every graph."""
        return prompt_bucket(tokens, self.longest)

    def can_run(self, tokens: int) -> bool:
        return self.bucket(tokens) is not None

    def run(self, ids: list[int], slot: int) -> torch.Tensor:
        """The logits [1, V] (in the model's dtype) of the last of a fresh prompt's `ids`, its KV written to
        `slot`'s pages (positions 0..n-1): the bucket's graph replayed, or its batch run eagerly if not captured."""
        n = len(ids)
        bucket = self.bucket(n)
        assert bucket is not None, f"no lone-prompt graph holds {n} tokens"
        pad = bucket - n
        copy_to_device([*ids, *[0] * pad, *range(n), *[0] * pad, *[slot] * n, *[self.padding_slot] * pad, n - 1],
                       self.inputs[bucket])
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._logits(bucket)
        graph.replay()
        return self.logits[bucket]
