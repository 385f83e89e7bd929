"""Which bytes go where: the (source, destination, length) segments of one chunk of one room.

Pure arithmetic on two ``KVLayout``s, vectorised with numpy:
- same heads on both sides: whole pages, with runs of pages that are consecutive on both
  sides merged into one segment per buffer;
- different TP sizes: the page ``[page_size, heads, head_dim]`` holds a head range as one
  strided row per token, so a head slice is one segment per token per buffer.

The first page of a chunk may start at a token offset (the decode side already holds the
prompt's first ``decode_prefix_len`` tokens, which may end mid-page).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.transfer.kv.layout import KVLayout


@dataclass(frozen=True)
class Segments:
    """Parallel arrays of absolute source addresses, destination addresses and lengths."""

    srcs: np.ndarray
    dsts: np.ndarray
    lens: np.ndarray

    @property
    def nbytes(self) -> int:
        # A room's aux segment is one number: numpy's sum costs more than Python's for so few.
        return int(self.lens.sum()) if len(self.lens) > 16 else sum(self.lens.tolist())

    def __len__(self) -> int:
        return len(self.lens)

    def batches(self, max_segments: int, as_lists: bool = True) -> list[tuple]:
        """Lists ready for Mooncake (or, ``as_lists=False``, the arrays' slices), at most ``max_segments`` each."""
        out = []
        for start in range(0, len(self.lens), max_segments):
            end = start + max_segments
            batch = (self.srcs[start:end], self.dsts[start:end], self.lens[start:end])
            out.append(tuple(a.tolist() for a in batch) if as_lists else batch)
        return out


EMPTY = Segments(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


_BASES: dict[int, tuple[KVLayout, np.ndarray]] = {}  # id(layout) -> (layout, its buffers' addresses)
BASES_KEPT = 1024


def buffer_bases(layout: KVLayout) -> np.ndarray:
    """The addresses of ``layout``'s buffers as an array, made once per layout object (a room's every
    chunk plans with the same two layouts; 64 buffers for Llama-3-8B)."""
    hit = _BASES.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    bases = np.array([b.ptr for b in layout.buffers], dtype=np.int64)
    bases.flags.writeable = False
    if len(_BASES) >= BASES_KEPT:
        _BASES.clear()
    _BASES[id(layout)] = (layout, bases)
    return bases


def page_segments(src: KVLayout, dst: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray,
                  first_token: int, head_start: int, head_count: int) -> Segments:
    """Segments copying heads ``[head_start, +head_count)`` of ``src_pages`` into ``dst_pages``.

    Both page arrays have one entry per page; the first page is copied from token
    ``first_token`` on, the others whole. Both layouts must hold the head range.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    if len(src_pages) == 0:
        return EMPTY
    if not 0 <= first_token < src.page_size:
        raise ValueError(f"first_token {first_token} outside a page of {src.page_size} tokens")
    sp = np.asarray(src_pages, dtype=np.int64)
    dp = np.asarray(dst_pages, dtype=np.int64)
    src_bases, dst_bases = buffer_bases(src), buffer_bases(dst)
    whole = (head_start == src.head_start == dst.head_start
             and head_count == src.head_count == dst.head_count)
    if whole:
        offs, doffs, lens = _page_runs(sp, dp, src.buffers[0].page_bytes, dst.buffers[0].page_bytes,
                                       first_token * src.token_bytes)
    else:
        offs, doffs, lens = _token_rows(src, dst, sp, dp, first_token, head_start, head_count)
    # Buffer-major: every run of buffer 0, then of buffer 1, ... (int64: addresses are below 2**63).
    return Segments((src_bases[:, None] + offs).ravel(), (dst_bases[:, None] + doffs).ravel(),
                    np.tile(lens, len(src_bases)))


def _page_runs(sp: np.ndarray, dp: np.ndarray, src_page_bytes: int, dst_page_bytes: int,
               first_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Offsets within a buffer and lengths of maximal runs of pages consecutive on both sides."""
    if src_page_bytes != dst_page_bytes:
        raise ValueError(f"page bytes differ: {src_page_bytes} vs {dst_page_bytes}")
    breaks = np.flatnonzero((np.diff(sp) != 1) | (np.diff(dp) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(sp)]))
    offs = sp[starts] * src_page_bytes
    doffs = dp[starts] * dst_page_bytes
    lens = (ends - starts) * src_page_bytes
    offs[0] += first_offset
    doffs[0] += first_offset
    lens[0] -= first_offset
    return offs, doffs, lens


def _token_rows(src: KVLayout, dst: KVLayout, sp: np.ndarray, dp: np.ndarray, first_token: int,
                head_start: int, head_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One segment per token: the head slice of that token's row."""
    if not (src.head_start <= head_start and head_start + head_count <= src.head_start + src.head_count):
        raise ValueError(f"source rank holds heads {src.head_start}+{src.head_count}, "
                         f"asked for {head_start}+{head_count}")
    if not (dst.head_start <= head_start and head_start + head_count <= dst.head_start + dst.head_count):
        raise ValueError(f"destination rank holds heads {dst.head_start}+{dst.head_count}, "
                         f"asked for {head_start}+{head_count}")
    tokens = np.arange(src.page_size, dtype=np.int64)
    src_rows = (sp[:, None] * src.buffers[0].page_bytes + tokens[None, :] * src.token_bytes
                + (head_start - src.head_start) * src.head_bytes)
    dst_rows = (dp[:, None] * dst.buffers[0].page_bytes + tokens[None, :] * dst.token_bytes
                + (head_start - dst.head_start) * dst.head_bytes)
    keep = np.ones_like(src_rows, dtype=bool)
    keep[0, :first_token] = False
    offs = src_rows[keep]
    doffs = dst_rows[keep]
    lens = np.full(len(offs), head_count * src.head_bytes, dtype=np.int64)
    return offs, doffs, lens


@dataclass(slots=True)  # not frozen: made once a room on the hot path (a frozen init costs ~3x)
class PageCopy:
    """One room's chunk as whole pages (every head both sides hold, from token 0) plus its aux segment
    (``aux``, or ``EMPTY``; or ``aux_slots``, the (source, destination) slot pair, which the merged plan turns
    into segments for all its rooms at once): not yet planned, so that a merged write plans all its rooms in
    one pass."""

    src: KVLayout
    dst: KVLayout
    src_pages: np.ndarray
    dst_pages: np.ndarray
    aux: Segments = EMPTY
    aux_slots: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        aux = aux_slot_bytes(self.src, self.dst) if self.aux_slots is not None else self.aux.nbytes
        return len(self.src_pages) * self.src.buffers[0].page_bytes * len(self.src.buffers) + aux


@dataclass(frozen=True)
class PageRuns:
    """Several rooms' whole pages between one pair of layouts, not yet expanded per buffer: runs of pages
    consecutive on both sides as byte offsets within *every* buffer (``src_offs``, ``dst_offs``, ``lens``),
    plus the rooms' aux segments. The same copy as ``segments()`` (one segment per run per buffer), in
    O(runs) numbers instead of O(runs x buffers): the CUDA IPC kernel expands it on the device."""

    src: KVLayout
    dst: KVLayout
    src_offs: np.ndarray
    dst_offs: np.ndarray
    lens: np.ndarray
    aux: Segments

    @property
    def nbytes(self) -> int:
        return int(self.lens.sum()) * len(self.src.buffers) + self.aux.nbytes

    def segments(self) -> Segments:
        """Every run of every buffer (buffer-major: buffer 0's runs, then buffer 1's, ...), then the aux."""
        if not len(self.lens):
            return self.aux
        src_bases, dst_bases = buffer_bases(self.src), buffer_bases(self.dst)
        pages = Segments((src_bases[:, None] + self.src_offs).ravel(), (dst_bases[:, None] + self.dst_offs).ravel(),
                         np.tile(self.lens, len(src_bases)))
        return concat([pages, self.aux])


def plan_page_runs(copies: list[PageCopy]) -> PageRuns:
    """Several rooms' ``PageCopy`` s with the same two layouts in one pass: their pages laid end to end,
    runs consecutive on both sides merged (never across two rooms), and the aux slots. A few numpy calls
    for a whole merged write (each room planned alone costs about as many)."""
    src, dst = copies[0].src, copies[0].dst
    if any(c.src is not src or c.dst is not dst for c in copies):
        raise ValueError("plan_page_runs takes copies between one pair of layouts")
    page_bytes = src.buffers[0].page_bytes
    if dst.buffers[0].page_bytes != page_bytes:
        raise ValueError(f"page bytes differ: {page_bytes} vs {dst.buffers[0].page_bytes}")
    copies_with_pages = [c for c in copies if len(c.src_pages)]
    aux = _aux_of(copies)
    if not copies_with_pages:
        empty = np.zeros(0, np.int64)
        return PageRuns(src, dst, empty, empty, empty, aux)
    if len(copies_with_pages) == 1:
        sp = np.asarray(copies_with_pages[0].src_pages, dtype=np.int64)
        dp = np.asarray(copies_with_pages[0].dst_pages, dtype=np.int64)
    else:
        sp = np.concatenate([c.src_pages for c in copies_with_pages]).astype(np.int64, copy=False)
        dp = np.concatenate([c.dst_pages for c in copies_with_pages]).astype(np.int64, copy=False)
    cut = np.empty(len(sp), dtype=bool)
    cut[0] = True
    np.not_equal(np.diff(sp), 1, out=cut[1:])
    cut[1:] |= np.diff(dp) != 1
    if len(copies_with_pages) > 1:
        cut[np.cumsum([len(c.src_pages) for c in copies_with_pages[:-1]])] = True
    starts = np.flatnonzero(cut)
    lens = np.diff(np.append(starts, len(sp))) * page_bytes
    return PageRuns(src, dst, sp[starts] * page_bytes, dp[starts] * page_bytes, lens, aux)


def plan_page_copies(copies: list[PageCopy]) -> Segments:
    """The segments of several rooms' ``PageCopy`` s with the same two layouts (``plan_page_runs``
    expanded per buffer): what a transport without page runs (Mooncake) writes."""
    return plan_page_runs(copies).segments()


def _aux_of(copies: list[PageCopy]) -> Segments:
    """The copies' aux segments in order: their slot pairs turned into addresses in one pass."""
    if all(c.aux_slots is None for c in copies):
        return concat([c.aux for c in copies])
    if all(c.aux_slots is not None for c in copies):  # the usual merged write: every room's last chunk
        src, dst = copies[0].src, copies[0].dst
        slots = np.array([c.aux_slots for c in copies], dtype=np.int64).reshape(len(copies), 2)
        return Segments(src.aux.ptr + slots[:, 0] * src.aux.slot_bytes, dst.aux.ptr + slots[:, 1] * dst.aux.slot_bytes,
                        np.full(len(copies), aux_slot_bytes(src, dst), dtype=np.int64))
    return concat([c.aux if c.aux_slots is None else aux_segment(c.src, c.aux_slots[0], c.dst, c.aux_slots[1])
                   for c in copies])


def aux_slot_bytes(src: KVLayout, dst: KVLayout) -> int:
    """Bytes of one aux slot's copy between two layouts."""
    return min(src.aux.slot_bytes, dst.aux.slot_bytes)


def aux_segment(src: KVLayout, src_slot: int, dst: KVLayout, dst_slot: int) -> Segments:
    """The one segment copying aux slot ``src_slot`` into the peer's ``dst_slot``."""
    one = np.array([src.aux.ptr + src_slot * src.aux.slot_bytes, dst.aux.ptr + dst_slot * dst.aux.slot_bytes,
                    aux_slot_bytes(src, dst)],
                   dtype=np.int64)  # one array, three views: every finishing room makes one
    return Segments(one[0:1], one[1:2], one[2:3])


def concat(parts: list[Segments]) -> Segments:
    """One ``Segments`` of several, in order."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return EMPTY
    return Segments(np.concatenate([p.srcs for p in parts]), np.concatenate([p.dsts for p in parts]),
                    np.concatenate([p.lens for p in parts]))
