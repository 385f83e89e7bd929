"""Radix tree of full KV pages keyed by their tokens: requests with a common prefix share pages.

Each node holds one page and the `page_size` tokens whose KV it stores; a path from the root
spells a prefix. The tree owns its pages. A request that matches a prefix locks the path (a
reference count per node), so those pages are not evicted while it runs; when it finishes, its
full pages are inserted and the lock is released. Unlocked leaves are evicted least recently
used first when the allocator runs dry. The unlocked leaves are kept listed as the tree changes,
in a heap by last use, so an eviction costs a few heap operations, not a walk over the whole tree
(with tens of thousands of cached pages, that walk made each decode step's page growth the engine's
bottleneck). A request's prompt pages also go in as soon as they
are computed (`extend`), so a request with the same prompt arriving meanwhile shares them, and
the partial last page of a computed prompt is listed as a *tail* of its path while its request
holds it, and may stay in the tree after it (a leaf keyed by fewer than a page of tokens), so
that such a request can copy that page instead of computing it again.

Every full page's node carries its page hash (`engine/page_hash.py`: the whole prefix it ends); with
an events sink (`PageEvents`) the cache reports each full page it gains and evicts, so routers know
where a prefix lives.

With a lower tier (`engine/host_kv.py`: `spill`), the full pages it evicts are written back there first,
by hash, and `KVCache.admit` brings them back into the tree; `flush` empties that tier too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitserve.engine.page_allocator import DeviceRead, PageAllocator
from splitserve.engine.page_events import PageEvents
from splitserve.engine.page_hash import next_hash, root_hash


@dataclass(eq=False)
class TreeNode:
    """One cached page: its tokens, its page index and who holds it."""

    key: tuple[int, ...]
    page: int
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    # Partial last pages of running requests' prompts that continue this path (tokens -> page):
    # owned by those requests, not the tree; another prompt may copy one (`next_page`).
    tails: dict[tuple[int, ...], int] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hash: int | None = None  # the page hash of a full page (and the root's seed); None for a partial leaf


@dataclass
class PrefixMatch:
    """A matched prefix: its pages (in order) and the deepest node, to lock and unlock."""

    pages: list[int]
    node: TreeNode

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class PrefixCache:
    """Page-granular radix tree with reference counts and LRU eviction."""

    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True,
                 events: PageEvents | None = None) -> None:
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = enabled
        self.events = events
        self.root = TreeNode(key=(), page=-1, parent=None, hash=root_hash(page_size))
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.locked_pages = 0
        # The unlocked leaves (what `evict` may take), and a heap of (last access, order, node) over them whose
        # entries go stale as nodes are used, locked or grow children (`evict` skips those; `_relist` drops
        # them once they outnumber the live ones).
        self._evictable: set[TreeNode] = set()
        self._lru: list[tuple[int, int, TreeNode]] = []
        self._order = itertools.count()
        # Hit-rate counters, in tokens, for /metrics.
        self.queried_tokens = 0
        self.hit_tokens = 0
        # A lower tier: `spill` takes the (hash, page) of the full pages evicted, before they are freed, and
        # returns the side-stream copies still reading them (none once done); `on_flush` is called when the
        # cache is flushed.
        self.spill: Callable[[list[tuple[int, int]]], Sequence[DeviceRead]] | None = None
        # A copy still writing a node's page (its load from the host tier), if any: an evicted page waits for it.
        self.copy_in_flight: Callable[[TreeNode], DeviceRead | None] | None = None
        self.on_flush: Callable[[], object] | None = None

    def _chunks(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, ...]]:
        n = min(len(tokens) // self.page_size, max_pages)
        return [tuple(tokens[i * self.page_size:(i + 1) * self.page_size]) for i in range(n)]

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of `tokens` (at most `max_tokens` of them), in whole pages."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node, pages = self.root, []
        if self.enabled:
            now = next(self._clock)
            for chunk in self._chunks(tokens, limit // self.page_size):
                child = node.children.get(chunk)
                if child is None:
                    break
                child.last_access = now
                pages.append(child.page)
                node = child
            self._list(node)  # its last use changed: the only node of the path that can be a leaf
        self.queried_tokens += limit
        self.hit_tokens += len(pages) * self.page_size
        return PrefixMatch(pages=pages, node=node)

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_pages += 1
                self._evictable.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref < 0:
                raise RuntimeError(f"prefix-cache page {node.page} unlocked more often than locked")
            if node.lock_ref == 0:
                self.locked_pages -= 1
                self._list(node)
            node = node.parent  # type: ignore[assignment]

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               keep_partial: bool = False) -> tuple[list[int], TreeNode]:
        """Adds the full pages of `tokens` (KV in `pages`) to the tree; with `keep_partial`, the
        partial last page too, as a leaf keyed by its fewer tokens: `match` never takes it (it walks
        whole pages), `next_page` finds it for a prompt that ends there, to copy.

        Returns the pages the caller still owns and must free (pages whose tokens were already
        cached by someone else, the partial last page unless kept) and the deepest full node.
        """
        if not self.enabled:
            return list(pages), self.root
        chunks = self._chunks(tokens, len(pages))
        node, now, leftover = self.root, next(self._clock), []
        for i, chunk in enumerate(chunks):
            child = node.children.get(chunk)
            if child is None:
                child = self._new_page_node(chunk, pages[i], node)
            elif child.page != pages[i]:
                leftover.append(pages[i])
            child.last_access = now
            node = child
        rest = list(pages[len(chunks):])
        partial = tuple(tokens[len(chunks) * self.page_size:])
        self._list(node)
        if keep_partial and rest and 0 < len(partial) < self.page_size and partial not in node.children:
            tail = node.children[partial] = TreeNode(key=partial, page=rest.pop(0), parent=node, last_access=now)
            self.cached_pages += 1
            self._evictable.discard(node)
            self._list(tail)
        leftover.extend(rest)
        return leftover, node

    def _new_page_node(self, chunk: tuple[int, ...], page: int, parent: TreeNode) -> TreeNode:
        """A full page's node under `parent`, hashed, counted and reported."""
        child = TreeNode(key=chunk, page=page, parent=parent, hash=next_hash(parent.hash, chunk))
        parent.children[chunk] = child
        self._evictable.discard(parent)
        self.cached_pages += 1
        if self.events is not None:
            self.events.stored(child.hash)
        return child

    def extend(self, node: TreeNode, chunks: Sequence[tuple[int, ...]], pages: Sequence[int]) -> TreeNode:
        """Hangs `pages` (KV of `chunks`, one page each) below `node`, the deepest node of the
        path they continue; returns the new deepest node. Stops at a chunk cached already with
        another page (someone else computed it too): the caller keeps its own page for it."""
        if not self.enabled:
            return node
        now = next(self._clock)
        for chunk, page in zip(chunks, pages, strict=True):
            child = node.children.get(chunk)
            if child is None:
                child = self._new_page_node(chunk, page, node)
            elif child.page != page:
                break
            child.last_access = now
            node = child
        self._list(node)
        return node

    def add_tail(self, node: TreeNode, tokens: tuple[int, ...], page: int) -> None:
        """Lists `page` (KV of `tokens`, fewer than a page, after `node`'s path) while its owner holds it."""
        if self.enabled:
            node.tails.setdefault(tokens, page)

    def remove_tail(self, node: TreeNode, tokens: tuple[int, ...], page: int) -> None:
        if node.tails.get(tokens) == page:
            del node.tails[tokens]

    def next_page(self, node: TreeNode, tokens: Sequence[int]) -> int | None:
        """A page holding the KV of `tokens` (the page after `node`'s path: a whole page of them, or
        fewer for a prompt's last page): a cached page, or a listed tail; None if there is none."""
        if not self.enabled:
            return None
        key = tuple(tokens)
        child = node.children.get(key)
        return child.page if child is not None else node.tails.get(key)

    def evict(self, num_pages: int, spill: bool = True) -> int:
        """Frees up to `num_pages` unlocked pages, least recently used leaves first (their full pages
        written back to the lower tier first, if there is one and `spill`)."""
        freed: list[int] = []
        spilled: list[tuple[int, int]] = []
        copies: dict[int, tuple[DeviceRead, ...]] = {}  # page -> the copies still touching it
        spill = spill and self.spill is not None
        while self._lru and len(freed) < num_pages:
            last_access, _, node = heapq.heappop(self._lru)
            if node not in self._evictable or last_access != node.last_access:
                continue  # a stale entry: locked, grown, used again (listed anew) or evicted since
            self._evictable.remove(node)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            freed.append(node.page)
            if self.copy_in_flight is not None and (load := self.copy_in_flight(node)) is not None:
                copies[node.page] = (load,)
            self.cached_pages -= 1
            if len(node.key) == self.page_size:
                if self.events is not None:
                    self.events.removed(node.hash)
                if spill:
                    spilled.append((node.hash, node.page))
            self._list(parent)
        readers = tuple(self.spill(spilled)) if spilled else ()  # type: ignore[misc]  (spill: set)
        for _, page in spilled if readers else ():  # the spilled pages settle once the copies reading them are done
            copies[page] = (*copies.get(page, ()), *readers)
        self.allocator.free([p for p in freed if p not in copies], cached=True)
        for page, read_by in copies.items():
            self.allocator.free([page], cached=True, read_by=read_by)
        return len(freed)

    def flush(self) -> int:
        """Evicts every unlocked page (the lower tier forgets its pages too); returns how many were freed."""
        freed = self.evict(self.cached_pages, spill=False)
        if self.on_flush is not None:
            self.on_flush()
        return freed

    def _list(self, node: TreeNode) -> None:
        """Lists `node` for eviction at its last use if it is an unlocked leaf (again, if it was listed before)."""
        if node is self.root or node.lock_ref or node.children:
            return
        self._evictable.add(node)
        heapq.heappush(self._lru, (node.last_access, next(self._order), node))
        if len(self._lru) > 2 * len(self._evictable) + 64:
            self._relist()

    def _relist(self) -> None:
        """The heap rebuilt from the evictable leaves alone (its stale entries dropped)."""
        self._lru = [(n.last_access, next(self._order), n) for n in self._evictable]
        heapq.heapify(self._lru)

    def leaves(self) -> list[TreeNode]:
        """Every leaf, by a walk over the whole tree (for checks: the unlocked ones are what is listed)."""
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    @property
    def listed_leaves(self) -> set[TreeNode]:
        """The leaves `evict` may take, as listed."""
        return set(self._evictable)
