"""Device-to-device copy of many (source, destination, length) segments in one kernel launch.

The CUDA IPC backend moves a chunk's KV as the transfer plan's segments (page runs of every
layer's K and V, a head slice per token, the aux slot), between this process's memory and a
peer's allocation mapped into it. One ``cudaMemcpy`` per segment would pay a launch per page
run and layer; instead the segments are cut into pieces of at most ``PIECE_BYTES`` (pure
arithmetic, ``split_into_pieces``) and one Triton program copies each piece.

Addresses reach the kernel as element offsets from an anchor tensor's address (pointer
arithmetic from a real tensor argument, so Triton sees an aligned base): 8-byte words where
every address and length is a multiple of 8 (KV pages are), bytes otherwise (the 12-byte aux
slots). The piece tables travel through one pinned buffer, reused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

WORD_BYTES = 8
WORD_BLOCK = 2048  # int64 elements per iteration of a program (16 KiB)
WORD_ITERS = 4  # iterations per program: a piece is 64 KiB
BYTE_BLOCK = 1024
BYTE_ITERS = 1
PIECE_BYTES = WORD_BLOCK * WORD_ITERS * WORD_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pieces:
    """Parallel arrays: source and destination offsets (in elements from the anchor) and lengths."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def table(self) -> np.ndarray:
        """``[3, n]`` int64, the kernel's input."""
        return np.stack([self.src, self.dst, self.length]).astype(np.int64)


def split_into_pieces(srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, piece: int) -> Pieces:
    """Cuts each segment into consecutive pieces of at most ``piece`` units (empty segments vanish)."""
    srcs, dsts, lens = (np.asarray(a, dtype=np.int64) for a in (srcs, dsts, lens))
    if piece < 1:
        raise ValueError(f"piece must be >= 1, got {piece}")
    if (lens < 0).any():
        raise ValueError("negative segment length")
    counts = (lens + piece - 1) // piece
    seg = np.repeat(np.arange(len(lens)), counts)
    first = np.cumsum(counts) - counts
    off = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)) * piece
    return Pieces(srcs[seg] + off, dsts[seg] + off, np.minimum(lens[seg] - off, piece))


def word_aligned(srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, nbytes: int = WORD_BYTES) -> np.ndarray:
    """Which segments start and end on ``nbytes`` boundaries on both sides."""
    return ((np.asarray(srcs) | np.asarray(dsts) | np.asarray(lens)) % nbytes) == 0


def plan_pieces(srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, anchor: int,
                word_piece_bytes: int = PIECE_BYTES) -> tuple[Pieces, Pieces]:
    """(word pieces, byte pieces) of absolute-address segments, as offsets from ``anchor``
    (16-byte aligned) in their own element size; word pieces hold at most ``word_piece_bytes``."""
    if anchor % 16:
        raise ValueError(f"anchor {anchor:#x} is not 16-byte aligned")
    srcs, dsts, lens = (np.asarray(a, dtype=np.int64) for a in (srcs, dsts, lens))
    words = word_aligned(srcs, dsts, lens)
    by_word = split_into_pieces((srcs[words] - anchor) // WORD_BYTES, (dsts[words] - anchor) // WORD_BYTES,
                                lens[words] // WORD_BYTES, word_piece_bytes // WORD_BYTES)
    rest = ~words
    by_byte = split_into_pieces(srcs[rest] - anchor, dsts[rest] - anchor, lens[rest], BYTE_BLOCK * BYTE_ITERS)
    return by_word, by_byte


def pairs_of_words(pieces: Pieces) -> bool:
    """Whether every word piece starts and ends on a 16-byte boundary (the kernel may then move 16 bytes
    per access)."""
    return not len(pieces) or bool((((pieces.src | pieces.dst | pieces.length) % 2) == 0).all())


_KERNEL: Any = None


def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is only needed where this backend runs)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["n"])  # one compiled kernel for any piece count
        def copy_pieces(anchor, table, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, PAIRS: tl.constexpr):
            pid = tl.program_id(0)
            src = tl.load(table + pid)
            dst = tl.load(table + n + pid)
            length = tl.load(table + 2 * n + pid)
            if PAIRS:  # offsets and lengths are even: 16-byte accesses
                src = tl.multiple_of(src, 2)
                dst = tl.multiple_of(dst, 2)
                length = tl.multiple_of(length, 2)
            for i in tl.static_range(ITERS):
                offs = i * BLOCK + tl.arange(0, BLOCK)
                mask = offs < length
                tl.store(anchor + dst + offs, tl.load(anchor + src + offs, mask=mask), mask=mask)

        _KERNEL = copy_pieces
    return _KERNEL


@dataclass(frozen=True)
class CopyShape:
    """How the word kernel cuts work: ``block`` words per access round, ``iters`` rounds per program
    (a piece is ``block * iters`` words), ``warps`` per program."""

    block: int = WORD_BLOCK
    iters: int = WORD_ITERS
    warps: int = 8

    @property
    def piece_bytes(self) -> int:
        return self.block * self.iters * WORD_BYTES


class SegmentCopier:
    """Copies absolute-address segments on one device: one launch per element size, on the current
    stream, returning once they landed. Thread-safe (one copy at a time: they share the tables).

    ``timed=True`` also measures the kernels alone (device events): ``last_kernel_s``. ``pairs=True`` tells
    Triton that 16-byte-aligned pieces are (``multiple_of``): on an H200 that made the kernel slower
    (0.72 against 0.88 of a device copy for 1 GiB of KV pages), so 8-byte accesses are the default."""

    def __init__(self, device: Any, shape: CopyShape = CopyShape(), pairs: bool = False, timed: bool = False) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.shape = shape
        self.timed = timed
        self.last_kernel_s = 0.0
        self._lock = threading.Lock()
        # Kernel offsets count from this tensor's address; it also gives the warm-up its bytes.
        self._anchor = torch.zeros(8, dtype=torch.int64, device=device)
        self._host = torch.empty(0, dtype=torch.int64).pin_memory()
        self._table = torch.empty(0, dtype=torch.int64, device=device)
        self._done = torch.cuda.Event()
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._pairs = pairs
        self._warm_up()

    def copy(self, srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray) -> None:
        """Copies every ``[src, src + len)`` to ``[dst, dst + len)`` (device addresses valid here)."""
        torch = self._torch
        words, raw = plan_pieces(srcs, dsts, lens, self._anchor.data_ptr(), self.shape.piece_bytes)
        raw_at = (3 * len(words) + 1) // 2 * 2  # the byte table starts 16-byte aligned, like the word table
        size = raw_at + 3 * len(raw)
        with self._lock, torch.cuda.device(self.device):
            if size > self._host.numel():
                capacity = max(size, 2 * self._host.numel(), 3 << 12)
                self._host = torch.empty(capacity, dtype=torch.int64).pin_memory()
                self._table = torch.empty(capacity, dtype=torch.int64, device=self.device)
            host = self._host.numpy()
            host[:3 * len(words)] = words.table().ravel()
            host[raw_at:size] = raw.table().ravel()
            self._table[:size].copy_(self._host[:size], non_blocking=True)
            kernel = _kernel()
            if self.timed:
                self._start.record()
            if len(words):
                kernel[(len(words),)](self._anchor, self._table, len(words), BLOCK=self.shape.block,
                                      ITERS=self.shape.iters, PAIRS=self._pairs and pairs_of_words(words),
                                      num_warps=self.shape.warps)
            if len(raw):
                kernel[(len(raw),)](self._anchor.view(torch.uint8), self._table[raw_at:], len(raw), BLOCK=BYTE_BLOCK,
                                    ITERS=BYTE_ITERS, PAIRS=False, num_warps=4)
            if self.timed:
                self._end.record()
            self._done.record()
            self._done.synchronize()  # the pinned table is reused by the next copy
            if self.timed:
                self.last_kernel_s = self._start.elapsed_time(self._end) / 1e3

    def _warm_up(self) -> None:
        """Compiles every kernel variant now, not on the first room, and checks what they copy:
        words 0-1 -> 2-3 (16-byte pairs), word 1 -> 5 (8-byte), bytes 0..4 -> 49..53."""
        anchor = self._anchor
        base = anchor.data_ptr()
        anchor[:2] = self._torch.tensor([7, 9])
        segments = (np.array([base]), np.array([base + 16]), np.array([16]))
        try:
            self.copy(*segments)
        except Exception as exc:  # a Triton without the alignment hints: 8-byte accesses only
            if not self._pairs:
                raise
            log.warning("16-byte copy kernel unavailable (%s); using 8-byte accesses", exc)
            self._pairs = False
            self.copy(*segments)
        self.copy(np.array([base + 8, base]), np.array([base + 40, base + 49]), np.array([8, 5]))
        got = anchor.cpu()
        raw = anchor.view(self._torch.uint8).cpu()
        if got[2:4].tolist() != [7, 9] or int(got[5]) != 9 or raw[49:54].tolist() != raw[:5].tolist():
            raise RuntimeError(f"segment copy warm-up copied the wrong bytes: {got.tolist()}")
