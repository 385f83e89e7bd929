"""Free-list allocator of KV pages; its free count is what admission and the tests look at."""

from __future__ import annotations

from splitserve.engine.kv_pool import SCRATCH_PAGE


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free."""


class DoubleFreeError(RuntimeError):
    """A page was freed that is already free (a bookkeeping bug, never silently ignored)."""


class PageAllocator:
    """Hands out page indices 1..num_pages-1 (page 0 is scratch)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 KV pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page numbers first, which keeps early pages warm.
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._is_free = [True] * num_pages
        self._is_free[SCRATCH_PAGE] = False

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == SCRATCH_PAGE or self._is_free[p]:
                raise DoubleFreeError(f"page {p} freed twice (or the scratch page)")
            self._is_free[p] = True
            self._free.append(p)
