"""How the paged extend kernel's programs cover an extend batch: built on the host, one copy in;
and which long chunks after a cached prefix go to cuDNN instead (engine/layers/prefix_chunk_attention.py).

Kept apart from the kernels (engine/layers/paged_extend_triton.py) so that batches can be
planned where Triton is not installed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# Query rows (tokens x group heads) per program: 256 measured fastest on an H200 for 16-bit heads
# of up to 128 (benchmarks/attention_sweep.py); wide tiles (float32, wider heads) take half as many
# (at 256 rows float32 needs more shared memory than the chip has).
ROWS_PER_PROGRAM = 256


def wide_tiles(head_dim: int, element_size: int) -> bool:
    return element_size > 2 or head_dim > 128
ALIGN = 4  # int32s: Triton compiles a kernel once per 16-byte alignment of each pointer it takes


def aligned(n: int) -> int:
    """`n` rounded up so that a section of int32s that starts aligned ends aligned."""
    return -(-n // ALIGN) * ALIGN


def padded(values: list[int]) -> list[int]:
    return values + [0] * (aligned(len(values)) - len(values))


# Full prompt chunks of at least this many tokens after a whole number of chunks (up to a cached prefix of
# CUDNN_PREFIX_MAX tokens) attend as two cuDNN calls merged by their log-sum-exps (benchmarks/attention_sweep.py,
# "cuDNN split" rows: 0.71-0.73 of the extend kernel's time at 2048 after 2048-6144; slower than it at 1024
# after 1024 and at 2048 after 512). cuDNN builds a graph per shape (50-110 ms each on an H200), so the path
# takes only shapes the warm-up builds: the chunk size by each multiple of it as the prefix.
CUDNN_CHUNK_MIN = 2048
CUDNN_PREFIX_MAX = 32768


@dataclass(frozen=True)
class PrefixChunk:
    """A chunk that attends through cuDNN: its index in the step, first flat row, new tokens, cached tokens
    before them, and where its KV locations (prefix then chunk, kv_len of them) start in the batch's
    prefix_chunk_loc."""

    index: int
    row: int
    length: int
    prefix: int
    loc_start: int

    @property
    def kv_len(self) -> int:
        return self.prefix + self.length


def cudnn_prefixes(chunk: int, context: int, max_prefix: int = CUDNN_PREFIX_MAX) -> list[int]:
    """The cached prefixes a full `chunk` may follow on the cuDNN path (each one cuDNN graph)."""
    return list(range(chunk, min(max_prefix, context - chunk) + 1, chunk))


def prefix_chunks(lengths: list[int], kv_lens: list[int], chunk: int, first_chunk: int = 0,
                  max_prefix: int = CUDNN_PREFIX_MAX) -> tuple[PrefixChunk, ...]:
    """The chunks (from `first_chunk`) for the cuDNN path: `chunk` new tokens after a prefix in cudnn_prefixes."""
    chosen, row, loc = [], 0, 0
    for c, (length, kv_len) in enumerate(zip(lengths, kv_lens, strict=True)):
        prefix = kv_len - length
        if c >= first_chunk and length == chunk and 0 < prefix <= max_prefix and prefix % chunk == 0:
            chosen.append(PrefixChunk(c, row, length, prefix, loc))
            loc += kv_len
        row += length
    return tuple(chosen)


def block_tokens(group: int, wide: bool) -> int:
    """Query tokens per program for a GQA group size (at least 16 tokens); `wide`: see wide_tiles."""
    rows = ROWS_PER_PROGRAM // 2 if wide else ROWS_PER_PROGRAM
    return max(16, rows // (1 << (group - 1).bit_length()))


@dataclass(frozen=True)
class ExtendPlan:
    """Where each chunk's queries and KV are, and which programs cover them (device int32 views)."""

    chunk_slot: torch.Tensor  # [C]
    chunk_row: torch.Tensor  # [C] first flat row of the chunk's new tokens
    chunk_len: torch.Tensor  # [C] new tokens
    chunk_kv_len: torch.Tensor  # [C] KV length after the step (cached prefix + new tokens)
    block_chunk: torch.Tensor  # [P] the chunk each program works on
    block_start: torch.Tensor  # [P] its first query, counted within the chunk

    @property
    def num_blocks(self) -> int:
        return int(self.block_chunk.shape[0])


def extend_plan_values(lengths: list[int], kv_lens: list[int], slots: list[int], tokens_per_block: int,
                       first_chunk: int = 0, skip_rows: frozenset[int] = frozenset()) -> tuple[list[int], int, int]:
    """The host side of an ExtendPlan for chunks `first_chunk..` of a step, but those whose first row is
    in `skip_rows` (they attend elsewhere), flattened into one list (one copy to the device): slots, rows,
    lengths, KV lengths, then the programs' chunks and starts, each section padded to 16 bytes."""
    starts = [0, *itertools.accumulate(lengths)][:-1]
    chosen = [c for c in range(first_chunk, len(lengths)) if starts[c] not in skip_rows]
    rows = [starts[c] for c in chosen]
    block_chunk, block_start = [], []
    for i, c in enumerate(chosen):
        # Latest queries first: they see the most keys, so the longest programs start earliest.
        for start in reversed(range(0, lengths[c], tokens_per_block)):
            block_chunk.append(i)
            block_start.append(start)
    values = (padded([slots[c] for c in chosen]) + padded(rows) + padded([lengths[c] for c in chosen])
              + padded([kv_lens[c] for c in chosen]) + padded(block_chunk) + padded(block_start))
    return values, len(chosen), len(block_chunk)


def extend_plan_from(values: torch.Tensor, num_chunks: int, num_blocks: int) -> ExtendPlan:
    """Views of a device tensor laid out by `extend_plan_values`."""
    c, p = aligned(num_chunks), aligned(num_blocks)
    n, m = num_chunks, num_blocks
    return ExtendPlan(values[:n], values[c:c + n], values[2 * c:2 * c + n], values[3 * c:3 * c + n],
                      values[4 * c:4 * c + m], values[4 * c + p:4 * c + p + m])
