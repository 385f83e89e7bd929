"""Device-to-device copy of many (source, destination, length) segments in one kernel launch.

The CUDA IPC backend moves a chunk's KV as the transfer plan's segments (page runs of every
layer's K and V, a head slice per token, the aux slot), between this process's memory and a
peer's allocation mapped into it. One ``cudaMemcpy`` per segment would pay a launch per page
run and layer; instead one Triton launch copies every segment of a chunk: program ``(s, p)``
copies pieces ``p, p + P, p + 2P, ...`` of segment ``s`` (a piece is 64 KiB of 8-byte words).

The host hands the kernel one row per *segment*, not per piece (``plan_copy``, pure
arithmetic): a 1 GiB chunk of 64 page runs is a 64-row table, so the host work does not grow
with the bytes. Addresses travel as element offsets from an anchor tensor's address (pointer
arithmetic from a real tensor argument, so Triton sees an aligned base): 8-byte words where
address and length are multiples of 8 (KV pages are), bytes otherwise (the 12-byte aux slot,
in the same launch). The table goes up through a pinned buffer, reused (one per concurrent copy).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

WORD_BYTES = 8
WORD_BLOCK = 2048  # int64 elements per access round of a program (16 KiB)
WORD_ITERS = 4  # rounds per piece: a piece is 64 KiB
BYTE_BLOCK = 1024
PIECE_BYTES = WORD_BLOCK * WORD_ITERS * WORD_BYTES
MAX_PARTS = 65535  # CUDA's limit on the grid's second dimension
SPARE_PROGRAMS = 4096  # programs with nothing to copy the grid may hold before long segments loop instead


@dataclass(frozen=True)
class CopyPlan:
    """The kernel's input: ``table`` ``[3, n]`` int64 (source and destination offsets from the anchor,
    lengths, each in its segment's element size; the ``words`` word segments first, then byte
    segments), and ``parts``, the programs per segment (the grid is ``(n, parts)``)."""

    table: np.ndarray
    words: int
    parts: int

    @property
    def segments(self) -> int:
        return self.table.shape[1]


def plan_copy(srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, anchor: int,
              piece_bytes: int = PIECE_BYTES) -> CopyPlan:
    """The copy of absolute-address segments as offsets from ``anchor`` (16-byte aligned); empty
    segments are dropped. ``parts`` covers the longest segment's pieces with one program each unless
    that leaves more than ``SPARE_PROGRAMS`` (and more than the pieces) idle: long segments then loop.
    Few passes over the arrays: a merged write of many rooms has hundreds of thousands of segments."""
    if anchor % 16:
        raise ValueError(f"anchor {anchor:#x} is not 16-byte aligned")
    srcs, dsts, lens = (np.asarray(a, dtype=np.int64) for a in (srcs, dsts, lens))
    if not len(lens):
        return CopyPlan(np.empty((3, 0), dtype=np.int64), 0, 1)
    if lens.min() <= 0:
        if (lens < 0).any():
            raise ValueError("negative segment length")
        keep = lens > 0
        srcs, dsts, lens = srcs[keep], dsts[keep], lens[keep]
        if not len(lens):
            return CopyPlan(np.empty((3, 0), dtype=np.int64), 0, 1)
    table = np.empty((3, len(lens)), dtype=np.int64)
    np.subtract(srcs, anchor, out=table[0])
    np.subtract(dsts, anchor, out=table[1])
    table[2] = lens
    odd = np.bitwise_or(table[0], table[1])
    np.bitwise_or(odd, lens, out=odd)
    np.bitwise_and(odd, WORD_BYTES - 1, out=odd)
    words = odd == 0
    n_words = int(np.count_nonzero(words))
    word_piece = piece_bytes // WORD_BYTES
    if n_words == len(lens):  # the usual write: KV pages only, all in words
        np.right_shift(table, 3, out=table)
        pieces = table[2] + (word_piece - 1)  # one temporary: fresh arrays cost page faults at this size
        pieces //= word_piece
    else:
        table = np.concatenate([table[:, words] // WORD_BYTES, table[:, ~words]], axis=1)
        unit = np.full(len(lens), BYTE_BLOCK, dtype=np.int64)
        unit[:n_words] = word_piece
        pieces = (table[2] + unit - 1) // unit
    total, longest = int(pieces.sum()), int(pieces.max())
    parts = longest
    if len(lens) * longest - total > max(SPARE_PROGRAMS, total):
        parts = max(1, -(-2 * total // len(lens)))
    return CopyPlan(table, n_words, min(parts, MAX_PARTS))


_KERNEL: Any = None


def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is only needed where this backend runs)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["n", "n_words"])  # one compiled kernel for any table
        def copy_segments(words, raw, table, n, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                          BYTE_BLOCK: tl.constexpr):
            seg = tl.program_id(0)
            part = tl.program_id(1).to(tl.int64)
            parts = tl.num_programs(1).to(tl.int64)
            src = tl.load(table + seg)
            dst = tl.load(table + n + seg)
            length = tl.load(table + 2 * n + seg)
            if seg < n_words:
                for start in range(part * (BLOCK * ITERS), length, parts * (BLOCK * ITERS)):
                    for i in tl.static_range(ITERS):
                        offs = start + i * BLOCK + tl.arange(0, BLOCK)
                        mask = offs < length
                        tl.store(words + dst + offs, tl.load(words + src + offs, mask=mask), mask=mask)
            else:
                for start in range(part * BYTE_BLOCK, length, parts * BYTE_BLOCK):
                    offs = start + tl.arange(0, BYTE_BLOCK)
                    mask = offs < length
                    tl.store(raw + dst + offs, tl.load(raw + src + offs, mask=mask), mask=mask)

        _KERNEL = copy_segments
    return _KERNEL


@dataclass(frozen=True)
class CopyShape:
    """How the kernel cuts work: ``block`` words per access round, ``iters`` rounds per piece (a piece is
    ``block * iters`` words), ``warps`` per program."""

    block: int = WORD_BLOCK
    iters: int = WORD_ITERS
    warps: int = 8

    @property
    def piece_bytes(self) -> int:
        return self.block * self.iters * WORD_BYTES


class _Staging:
    """One copy's table on its way to the device: pinned host rows, their device copy, and the event that
    says the kernel reading them finished (a staging buffer is reused only after that)."""

    def __init__(self, torch: Any, device: Any, rows: int) -> None:
        self.host = torch.empty(3 * rows, dtype=torch.int64).pin_memory()
        self.host_np = self.host.numpy()
        self.table = torch.empty(3 * rows, dtype=torch.int64, device=device)
        # Blocking: the waiting thread sleeps until the kernel ends instead of spinning a core (a merged write
        # waits milliseconds, and the prefill's other threads, the engine's too, want that CPU).
        self.done = torch.cuda.Event(blocking=True)


class SegmentCopier:
    """Copies absolute-address segments on one device: one launch per call, on the calling thread's
    current stream, returning once they landed. Thread-safe: concurrent calls (a worker per peer lane)
    each take a staging buffer of their own, so one call's launch is queued while another's kernel runs.

    ``timed=True`` also measures the kernel alone (device events): ``last_kernel_s``."""

    def __init__(self, device: Any, shape: CopyShape = CopyShape(), timed: bool = False) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.shape = shape
        self.timed = timed
        self.last_kernel_s = 0.0
        self._lock = threading.Lock()
        # Kernel offsets count from this tensor's address; it also gives the warm-up its bytes.
        self._anchor = torch.zeros(8, dtype=torch.int64, device=device)
        self._anchor_bytes = self._anchor.view(torch.uint8)
        self._anchor_ptr = self._anchor.data_ptr()
        self._free: list[_Staging] = []
        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._warm_up()

    def copy(self, srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray) -> None:
        """Copies every ``[src, src + len)`` to ``[dst, dst + len)`` (device addresses valid here)."""
        plan = plan_copy(srcs, dsts, lens, self._anchor_ptr, self.shape.piece_bytes)
        n = plan.segments
        if not n:
            return
        torch = self._torch
        staging = self._take(n)
        try:
            with torch.cuda.device(self.device):
                staging.host_np[:3 * n] = plan.table.ravel()
                staging.table[:3 * n].copy_(staging.host[:3 * n], non_blocking=True)
                timed = self.timed
                if timed:
                    self._start.record()
                _kernel()[(n, plan.parts)](self._anchor, self._anchor_bytes, staging.table, n, plan.words,
                                           BLOCK=self.shape.block, ITERS=self.shape.iters, BYTE_BLOCK=BYTE_BLOCK,
                                           num_warps=self.shape.warps)
                if timed:
                    self._end.record()
                staging.done.record()
                staging.done.synchronize()  # asleep, the GIL released
                if timed:
                    self.last_kernel_s = self._start.elapsed_time(self._end) / 1e3
        finally:
            with self._lock:
                self._free.append(staging)

    def _take(self, rows: int) -> _Staging:
        with self._lock:
            for i, staging in enumerate(self._free):
                if staging.host.numel() >= 3 * rows:
                    return self._free.pop(i)
            if self._free:
                self._free.pop(0)  # too small: replaced by a larger one
        return _Staging(self._torch, self.device, max(rows, 1024))

    def _warm_up(self) -> None:
        """Compiles the kernel now, not on the first room, and checks what it copies: word 1 -> 5
        (8-byte) and bytes 0..4 -> 49..53, in one launch."""
        anchor = self._anchor
        base = self._anchor_ptr
        anchor[:2] = self._torch.tensor([7, 9])
        self.copy(np.array([base + 8, base]), np.array([base + 40, base + 49]), np.array([8, 5]))
        got = anchor.cpu()
        raw = self._anchor_bytes.cpu()
        if int(got[5]) != 9 or raw[49:54].tolist() != raw[:5].tolist():
            raise RuntimeError(f"segment copy warm-up copied the wrong bytes: {got.tolist()}")
