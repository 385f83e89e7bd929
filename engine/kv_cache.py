"""A request's hold on the KV cache: its slot, its pages, its locked prefix.

Ties the page allocator, the prefix cache and the request-to-page table together so that
the scheduler and the roles take and give back KV resources in one place. Every page a
request holds is either shared from the prefix cache (locked) or its own; `release` returns
its own full pages to the cache and frees the rest, so after every request the pages are
back: free + cached == capacity, locked == 0.

Partial pages: admission shares whole pages only, and keeps one token to run. The tokens past the
shared pages (fewer than a page) are copied, with `copy_page` (one device copy of a page), from a
page that holds them already: the next cached page (a prompt that ends on a page boundary), or the
partial last page of a running request's computed prompt, which `publish_prompt` lists on its
path while the request holds it (the n samples of one prompt), or such a page the prefix cache
kept when its request ended with no output in it (`release`: a prefill engine's request). Only
the last token then runs.

Host tier (`host`, engine/host_kv.py): where the device match ends, the prompt's following full pages
are looked up by page hash in the host pool; the hits are loaded into fresh pages and hung in the
prefix tree below the match (locked by the request like any matched page, counted in `cached_len`).
On CUDA the load is asynchronous: the request, and any other that matches those pages before the load
is done, waits (`waits_for_load`) while the other requests run.

Store tier (`store`, engine/store_kv.py, shared by the deployment's engines): the full pages the tree
evicts are also written through to it (after the host tier's write-back); where the host match ends,
the following pages are looked up there by key and the hits loaded into fresh pages the same way
(synchronously: the lookup waits at most the store's timeout, the copy is queued on the compute stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from splitserve.engine.host_kv import HostKVPool, PendingLoad
from splitserve.engine.page_allocator import OutOfPagesError, PageAllocator
from splitserve.engine.page_events import PageEvents
from splitserve.engine.page_hash import next_hash
from splitserve.engine.prefix_cache import PrefixCache, PrefixMatch, TreeNode
from splitserve.engine.request import Request
from splitserve.engine.runner.host_to_device import to_device
from splitserve.engine.store_kv import StoreKV


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of where the pages are, for metrics and leak checks."""

    capacity: int
    free: int
    cached: int
    locked: int
    slots_in_use: int

    @property
    def used_by_requests(self) -> int:
        return self.capacity - self.free - (self.cached - self.locked)

    @property
    def available(self) -> int:
        """Pages an allocation can get right now (free, or cached and evictable)."""
        return self.free + self.cached - self.locked


class KVCache:
    """Slots, pages and prefix sharing for the requests of one engine."""

    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_context: int,
                 device: torch.device, prefix_caching: bool = True,
                 copy_page: Callable[[int, int], None] | None = None, page_events: PageEvents | None = None,
                 host: HostKVPool | None = None, store: StoreKV | None = None) -> None:
        self.page_size = page_size
        self.copy_page = copy_page  # (src, dst): the runner's copy of one KV page (None: never copy)
        # Request id -> its computed prompt's tail (path node, tokens, page); one holder's is listed.
        self._tails: dict[str, tuple[TreeNode, tuple[int, ...], int]] = {}
        self.max_slots = max_slots
        self.max_pages_per_request = -(-max_context // page_size)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(page_size, self.allocator, enabled=prefix_caching, events=page_events)
        # The host tier (None: off; nothing to do without a prefix cache).
        self.host = host if prefix_caching else None
        if self.host is not None:
            self.prefix_cache.spill = self.host.write_back
            self.prefix_cache.on_flush = self.host.clear
        # The shared store tier (None: off): written through as pages leave the device, after the host tier.
        self.store = store if prefix_caching else None
        if self.store is not None:
            self.prefix_cache.spill = self._spill_to_store if self.host is not None else self.store.offer
        # Loads in flight (CUDA): per request that waits for them, and per tree node they fill.
        self._loads: dict[str, list[PendingLoad]] = {}
        self._loading_nodes: dict[TreeNode, PendingLoad] = {}
        self.prefix_cache.copy_in_flight = self._load_in_flight
        # The request-to-page table: row `slot` lists the request's pages in order. The runner
        # gathers token locations from it on the device, without rebuilding lists every step.
        # One extra row, never handed out, points at the scratch page: padded rows (CUDA-graph
        # buckets) use it so that they read and write nothing a request owns.
        self.padding_slot = max_slots
        self.page_table = torch.zeros(max_slots + 1, self.max_pages_per_request, dtype=torch.int32, device=device)
        self._free_slots = list(range(max_slots - 1, -1, -1))

    def usage(self) -> KVUsage:
        return KVUsage(
            capacity=self.allocator.capacity,
            free=self.allocator.free_count,
            cached=self.prefix_cache.cached_pages,
            locked=self.prefix_cache.locked_pages,
            slots_in_use=self.max_slots - len(self._free_slots),
        )

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def available_pages(self) -> int:
        return self.usage().available

    @property
    def copies_partial_pages(self) -> bool:
        """Whether admission may copy the tokens past the shared pages (see the module docstring)."""
        return self.copy_page is not None and self.prefix_cache.enabled

    def admit(self, req: Request, max_prefix_tokens: int, copy_partial: bool = False) -> None:
        """Gives `req` a slot and the pages of its longest cached prefix (at most the given tokens);
        with `copy_partial`, also a copy of the page that holds the tokens after them, if one does."""
        if not self._free_slots:
            raise OutOfPagesError("no free request slot")
        match = self.prefix_cache.match(req.cache_ids, max_prefix_tokens)
        self.prefix_cache.lock(match.node)
        if self._loading_nodes:
            self._wait_for_loads_on_path(req, match.node)
        if self.host is not None and self.host.held:
            match = self._load_from_host(req, match, max_prefix_tokens)
        if self.store is not None:
            match = self._load_from_store(req, match, max_prefix_tokens)
        req.slot = self._free_slots.pop()
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.kv_len = req.cached_len = req.published_len = match.num_pages * self.page_size
        if match.pages:
            self.page_table[req.slot, : match.num_pages] = to_device(match.pages, torch.int32, self.page_table.device)
        if copy_partial and self.copies_partial_pages:
            self._copy_partial_page(req, match, max_prefix_tokens)

    def _load_from_host(self, req: Request, match: PrefixMatch, max_prefix_tokens: int) -> PrefixMatch:
        """Continues `match` (locked) with the prompt's next full pages found in the host tier, loaded into
        fresh pages and hung in the tree; returns the longer match, locked instead of `match`."""
        host = self.host
        assert host is not None
        hashes: list[int] = []
        chunks: list[tuple[int, ...]] = []
        for h, chunk in self._pages_after(req, match, max_prefix_tokens):
            if h not in host:
                break
            hashes.append(h)
            chunks.append(chunk)
        if not hashes:
            return match
        # Pinned first: taking device pages may evict some, which writes back, which may evict host pages.
        slots = host.pin(hashes)
        n = min(len(hashes), self.available_pages())
        pages = self.take_pages(n) if n else None
        if pages is None:
            host.unpin(slots)
            return match
        host.unpin(slots[n:])
        load = host.load(slots[:n], pages)
        longer = self._hang(match, chunks[:n], pages)  # new nodes: nothing on this path
        node = longer.node
        host.hit_tokens += n * self.page_size
        if load is not None:
            self._loads.setdefault(req.request_id, []).append(load)
            walk = node
            while walk is not match.node:
                load.nodes.append(walk)
                self._loading_nodes[walk] = load
                walk = walk.parent  # type: ignore[assignment]
        return longer

    def _spill_to_store(self, evicted: list[tuple[int, int]]) -> tuple[torch.cuda.Event, ...]:
        assert self.host is not None and self.store is not None
        return self.host.write_back(evicted) + self.store.offer(evicted)

    def _load_from_store(self, req: Request, match: PrefixMatch, max_prefix_tokens: int) -> PrefixMatch:
        """Continues `match` (locked) with the prompt's next full pages found in the store, copied into fresh
        pages and hung in the tree; returns the longer match, locked instead of `match`."""
        store = self.store
        assert store is not None
        if not store.available():
            return match
        if self.available_pages() < self.pages_for(req.total_len) - match.num_pages:
            return match  # the scheduler would release it at once for want of pages: no store call for it
        following = list(self._pages_after(req, match, max_prefix_tokens))
        if not following:
            return match
        hashes = [h for h, _ in following]
        chunks = [chunk for _, chunk in following]
        found = store.fetch(hashes)
        if found is None:
            return match
        slots, started = found
        n = min(len(slots), self.available_pages())
        pages = self.take_pages(n) if n else None
        if pages is None:
            store.give_back(slots)
            return match
        store.give_back(slots[n:])
        store.load_into(slots[:n], pages, started)
        return self._hang(match, chunks[:n], pages)

    def _pages_after(self, req: Request, match: PrefixMatch,
                     max_prefix_tokens: int) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(page hash, tokens) of the prompt's full pages after `match`, up to `max_prefix_tokens`: what a lower
        tier may hold; hashed as they are taken (a lookup that stops at a miss hashes no further). None when
        the match ends on a partial page or at the limit."""
        ps, key = self.page_size, req.cache_ids
        h = match.node.hash
        if h is None:
            return
        for i in range(match.num_pages, min(max_prefix_tokens, len(key)) // ps):
            chunk = tuple(key[i * ps:(i + 1) * ps])
            h = next_hash(h, chunk)
            yield h, chunk

    def _hang(self, match: PrefixMatch, chunks: list[tuple[int, ...]], pages: list[int]) -> PrefixMatch:
        """Hangs `pages` (filled with `chunks`' KV) in the tree below `match` and moves the lock to the new end."""
        node = self.prefix_cache.extend(match.node, chunks, pages)
        self.prefix_cache.lock(node)
        self.prefix_cache.unlock(match.node)
        return PrefixMatch(pages=[*match.pages, *pages], node=node)

    def _load_in_flight(self, node: TreeNode) -> torch.cuda.Event | None:
        """The event of a host load still filling `node`'s page (evicted, its page waits for it)."""
        load = self._loading_nodes.get(node)
        return load.event if load is not None and not load.ready() else None

    def _wait_for_loads_on_path(self, req: Request, node: TreeNode) -> None:
        """`req` matched pages a load still fills (another request's): it waits for that load too."""
        waits: list[PendingLoad] = []
        while node.parent is not None:
            load = self._loading_nodes.get(node)
            if load is not None and load not in waits:
                waits.append(load)
            node = node.parent
        if waits:
            self._loads.setdefault(req.request_id, []).extend(waits)

    @property
    def loading(self) -> bool:
        """Whether any request waits for a host load (CUDA)."""
        return bool(self._loads)

    def waits_for_load(self, req: Request) -> bool:
        """Whether `req`'s pages are still being loaded from the host tier (it must not run yet)."""
        loads = self._loads.get(req.request_id)
        if loads is None:
            return False
        if all(load.ready() for load in loads):
            del self._loads[req.request_id]
            return False
        return True

    def reap_loads(self) -> None:
        """Bookkeeping of the host loads that completed (their host pages unpinned, latencies noted)."""
        if self.host is None:
            return
        for load in self.host.reap():
            for node in load.nodes:
                if self._loading_nodes.get(node) is load:
                    del self._loading_nodes[node]

    def _copy_partial_page(self, req: Request, match: PrefixMatch, max_prefix_tokens: int) -> None:
        """The tokens past the matched pages, up to `max_prefix_tokens` (fewer than a page), copied
        from a page that holds their KV already into a page of `req`'s own."""
        start = match.num_pages * self.page_size
        key = req.cache_ids
        take = min(max_prefix_tokens, len(key)) - start
        if not 0 < take < self.page_size:
            return
        src = self.prefix_cache.next_page(match.node, key[start:min(len(key), start + self.page_size)])
        if src is None:
            return
        pages = self.take_pages(1)
        if pages is None:
            return
        if self._loading_nodes and self.host is not None:
            self.host.fence()  # the source page may be one a load still fills
        self.copy_page(src, pages[0])  # type: ignore[misc]  (copies_partial_pages: set)
        req.pages.append(pages[0])
        self.page_table[req.slot, match.num_pages] = to_device(pages, torch.int32, self.page_table.device)
        req.kv_len = req.cached_len = start + take

    def grow(self, req: Request, num_tokens: int, settled: bool = False) -> bool:
        """Makes room for `req`'s KV to reach `num_tokens` tokens; False if pages ran out. `settled`: only
        pages no queued step writes (PageAllocator), for KV that a writer outside the engine's stream copies in."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if need + len(req.pages) > self.max_pages_per_request:
            raise ValueError(
                f"request {req.request_id}: {num_tokens} tokens exceed the context of "
                f"{self.max_pages_per_request * self.page_size}"
            )
        pages = self.take_pages(need, settled)
        if pages is None:
            return False
        start = len(req.pages)
        req.pages.extend(pages)
        self.page_table[req.slot, start:start + need] = to_device(pages, torch.int32, self.page_table.device)
        return True

    def take_pages(self, n: int, settled: bool = False) -> list[int] | None:
        """n free pages (`settled`: settled ones), evicting unlocked cached pages if needed; None if there aren't
        enough (a page evicted while a step is queued settles when that step completes, one written back to a
        lower tier when its copy is done: pages still being copied count as on their way, so a retry does not
        evict again for them)."""
        def free() -> int:
            return self.allocator.settled_count if settled else self.allocator.free_count

        short = n - free() - (self.allocator.reading_count if settled else 0)
        if short > 0:
            self.prefix_cache.evict(short)
        if free() < n:
            return None
        return self.allocator.alloc(n, settled_only=settled)

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Frees `req`'s own pages past those `num_tokens` tokens need (rejected draft positions,
        a drafter's truncated drafts); its KV length drops to at most `num_tokens`."""
        keep = self.pages_for(num_tokens)
        req.kv_len = min(req.kv_len, num_tokens)
        if keep >= len(req.pages):
            return
        if keep < len(self._shared_pages(req)):
            raise ValueError(f"request {req.request_id}: cannot shrink to {num_tokens} tokens, into the "
                             "pages it shares with the prefix cache")
        tail = self._tails.get(req.request_id)
        if tail is not None and tail[2] in req.pages[keep:]:
            self._unlist_tail(req)
        self.allocator.free(req.pages[keep:])
        del req.pages[keep:]

    def publish_prompt(self, req: Request, computed_len: int) -> None:
        """Puts the full pages of `req`'s prompt computed so far (`computed_len` tokens of KV
        written) in the prefix cache at once, locked by `req`, instead of when it ends: a request
        with the same prompt (the n samples of one) then finds them instead of computing them."""
        if req.prefix_node is None or not self.prefix_cache.enabled:
            return
        full = min(computed_len, len(req.prompt_ids)) // self.page_size
        done = req.published_len // self.page_size
        if full > done:
            key = req.cache_ids
            chunks = [tuple(key[i * self.page_size:(i + 1) * self.page_size]) for i in range(done, full)]
            node = self.prefix_cache.extend(req.prefix_node, chunks, req.pages[done:full])
            self.prefix_cache.lock(node)
            self.prefix_cache.unlock(req.prefix_node)
            req.prefix_node = node
            # A chunk cached by another request stops the path: the rest of this prompt stays its own.
            req.published_len = full * self.page_size if len(self._shared_pages(req)) == full else len(req.prompt_ids)
        prompt_done = computed_len >= len(req.prompt_ids) and req.published_len < len(req.prompt_ids)
        if prompt_done and self.copies_partial_pages:
            self._list_tail(req)

    def _list_tail(self, req: Request) -> None:
        """The computed prompt's partial last page, listed on its path while `req` holds it; the
        whole prompt then counts as published (the scheduler's samples stop waiting for it)."""
        n = len(req.prompt_ids)
        full = n // self.page_size
        if n % self.page_size == 0 or len(req.pages) <= full or req.prefix_node is None:
            return  # no partial last page
        if req.published_len != full * self.page_size:
            return  # the path stopped short of the prompt's full pages
        tail = (req.prefix_node, tuple(req.cache_ids[full * self.page_size:n]), req.pages[full])
        self._tails[req.request_id] = tail  # every holder is known: one listed, the others its successors
        self.prefix_cache.add_tail(*tail)  # unless another holder's page is listed for these tokens
        req.published_len = n

    def _unlist_tail(self, req: Request) -> None:
        """`req` gives its tail page back: if it was the listed one, another holder's takes its place."""
        tail = self._tails.pop(req.request_id, None)
        if tail is None:
            return
        node, tokens, _ = tail
        self.prefix_cache.remove_tail(*tail)
        if tokens not in node.tails:
            successor = next((t for t in self._tails.values() if t[0] is node and t[1] == tokens), None)
            if successor is not None:
                self.prefix_cache.add_tail(*successor)

    def release(self, req: Request, cache_prefix: bool = True) -> None:
        """Gives back everything `req` holds; its computed full pages go to the prefix cache."""
        if req.slot < 0:
            return
        loads = self._loads.pop(req.request_id, None)
        if loads and self.page_table.device.type == "cuda":
            # Its pages may be freed or evicted now: nothing queued later may touch them before they are loaded.
            main = torch.cuda.current_stream(self.page_table.device)
            for load in loads:
                if not load.ready():
                    main.wait_event(load.event)
        self._unlist_tail(req)  # before its page is freed: nobody may copy it any more
        own_pages = req.pages[len(self._shared_pages(req)):]  # (those shared from the cache stay there)
        # They may still be written by a step in flight (a row of it queued before it ended): noted, so one that
        # the cache takes and evicts while that step runs is not given to a remote writer.
        self.allocator.note_written(own_pages)
        own_tokens = req.cache_ids[: req.kv_len] if cache_prefix else []
        if cache_prefix:
            # A partial last page holding just the prompt's tail (a prefill engine's request) stays for
            # the prompt's other samples to copy; one with output tokens in it would serve no prompt.
            keep = self.copies_partial_pages and req.kv_len == len(req.prompt_ids)
            leftover, _ = self.prefix_cache.insert(own_tokens, req.pages, keep_partial=keep)
        else:
            leftover = own_pages
        self.allocator.free(leftover)
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
        self._free_slots.append(req.slot)
        # sampler_slot too: its slot's sampler and grammar state may be another request's before it is back.
        req.slot, req.sampler_slot, req.pages, req.kv_len, req.prefix_node = -1, -1, [], 0, None
        req.published_len, req.publishing = 0, False

    def _shared_pages(self, req: Request) -> list[int]:
        node, shared = req.prefix_node, []
        while node is not None and node.parent is not None:
            shared.append(node.page)
            node = node.parent
        return shared[::-1]
