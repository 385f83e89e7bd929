"""Free-list allocator of KV pages; its free count is what admission and the tests look at."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from splitserve.engine.kv_pool import SCRATCH_PAGE


class DeviceRead(Protocol):
    """A copy queued on a side stream that still reads pages (a CUDA event recorded after it)."""

    def query(self) -> bool: ...


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free."""


class DoubleFreeError(RuntimeError):
    """A page was freed that is already free (a bookkeeping bug, never silently ignored)."""


class PageAllocator:
    """Hands out page indices 1..num_pages-1 (page 0 is scratch).

    A page freed while a step is queued on the device may still be written by it (a request that ended while
    its row sat in the step the overlap scheduler had already launched writes that row's KV into its tail
    page). Such a page is free for the engine's own steps, which run after that one on the same stream, but
    not for a writer outside that order: a decode's KV receiver, into whose pages another process copies
    whenever its KV is ready. So a page freed while step s is in flight settles when s completes (the engine
    says which steps it launched and completed), and `alloc(settled_only=True)` hands out settled pages only;
    the engine's own allocations take the settling ones first, leaving the settled ones for the receivers.

    A page a request gives to the prefix cache is noted with the step in flight then (`note_written`): when it
    is evicted later (`free(..., cached=True)`) it settles at once unless that step is still queued, so a
    decode whose free pages all sit in its prefix cache is not held back a step for every eviction.

    A page evicted to a lower tier is read by a copy on a side stream (`free(..., read_by=events)`). The engine's
    stream waits for that copy, so its own steps may take the page; a writer outside that order may not until
    the copy is done."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page numbers first, which keeps early pages warm.
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._is_free = [True] * num_pages
        self._is_free[SCRATCH_PAGE] = False
        self._settling: list[tuple[int, int]] = []  # (the step that may still write it, page), in freeing order
        self._launched = self._completed = 0
        self._written: dict[int, int] = {}  # a cached page -> the step in flight when its request let it go
        self._read: list[tuple[Sequence[DeviceRead], int, int]] = []  # (the copies reading it, step as above, page)
        self._readers: dict[int, Sequence[DeviceRead]] = {}  # a page taken from _read: the copies it still waits for

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free) + len(self._settling) + len(self._read)

    @property
    def settled_count(self) -> int:
        """Free pages no queued step writes and no side-stream copy reads: what a writer outside the engine's
        stream may be given."""
        self._reap_reads()
        return len(self._free)

    @property
    def reading_count(self) -> int:
        """Free pages still read by a side-stream copy (evicted to a lower tier): settled once it is done."""
        self._reap_reads()
        return len(self._read)

    @staticmethod
    def _done(readers: Sequence[DeviceRead]) -> bool:
        return all(r.query() for r in readers)

    def _reap_reads(self) -> None:
        """The pages whose side-stream copies are done settle as any freed page does (the step rule)."""
        if not self._read:
            return
        done: dict[int, bool] = {}
        still = []
        for readers, written, page in self._read:
            key = id(readers)
            if key not in done:
                done[key] = self._done(readers)
            if not done[key]:
                still.append((readers, written, page))
            elif written > self._completed:
                self._settling.append((written, page))
            else:
                self._free.append(page)
        self._read = still

    def step_launched(self, step: int) -> None:
        """The engine queued step `step` (increasing): a page freed from now on may be written by it."""
        self._launched = step

    def step_completed(self, step: int) -> None:
        """Step `step` finished on the device: the pages freed while it was queued are settled (the whole list
        is looked at: pages whose copies completed join it out of step order)."""
        self._completed = max(self._completed, step)
        if any(written <= self._completed for written, _ in self._settling):
            self._free.extend(page for written, page in self._settling if written <= self._completed)
            self._settling = [(w, page) for w, page in self._settling if w > self._completed]

    @property
    def _in_flight(self) -> int:
        return self._launched if self._launched > self._completed else 0

    def note_written(self, pages: list[int]) -> None:
        """`pages` leave their request for the prefix cache: a step in flight now may still write them."""
        if in_flight := self._in_flight:
            for p in pages:
                self._written[p] = in_flight

    def alloc(self, n: int, settled_only: bool = False) -> list[int]:
        available = self.settled_count if settled_only else self.free_count
        if n > available:
            raise OutOfPagesError(f"asked for {n} {'settled ' if settled_only else ''}KV pages, {available} free")
        pages = []
        if not settled_only:
            while self._settling and len(pages) < n:  # the newest first: the settled ones stay for receivers
                pages.append(self._settling.pop()[1])
            while self._read and len(pages) < n:  # the engine's stream waits for the copies that read them
                readers, _, page = self._read.pop()
                if not self._done(readers):  # freed again before they are done, it waits for them again
                    self._readers[page] = readers
                pages.append(page)
        pages.extend(self._free.pop() for _ in range(n - len(pages)))
        for p in pages:
            self._is_free[p] = False
            self._written.pop(p, None)
        return pages

    def free(self, pages: list[int], cached: bool = False, read_by: Sequence[DeviceRead] = ()) -> None:
        """Gives `pages` back. A request's own pages may be written by the step in flight (settling until it
        completes); `cached` ones (evicted from the prefix cache) only by the step noted when they were cached.
        `read_by`: side-stream copies that still read them (a write-back to a lower tier); they settle once
        every one of those is done, and the step rule holds as well."""
        in_flight = self._in_flight
        for p in pages:
            if p == SCRATCH_PAGE or self._is_free[p]:
                raise DoubleFreeError(f"page {p} freed twice (or the scratch page)")
            self._is_free[p] = True
            written = self._written.pop(p, 0) if cached else in_flight
            readers = read_by
            if (earlier := self._readers.pop(p, None)) is not None and not self._done(earlier):
                readers = (*readers, *earlier)  # taken by the engine and given back before those copies were done
            if readers:
                self._read.append((readers, written, p))
            elif written > self._completed:
                self._settling.append((written, p))
            else:
                self._free.append(p)
