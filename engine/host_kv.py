"""The host-memory tier under the device prefix cache: full KV pages keyed by their page hash, LRU.

When the prefix cache evicts a full page, its KV is written back here (unless a page of that hash is
here already); when a prompt's device match ends, `KVCache.admit` looks its following full pages up
here by hash and loads the hits into fresh device pages, which go into the prefix tree like any
computed page. See docs/kv_tiers.md.

Layout: [pages, layers, 2 (k, v), page_size, kv_heads, head_dim], one host page contiguous (one
memcpy each way). On a CUDA device the buffer is pinned and the copies run on two side streams:
- write-backs (device -> host): the side stream waits for the work queued on the compute stream so
  far, copies, and the compute stream waits for that copy before anything queued later (the evicted
  device page is handed out again right away, and a later step may write it). A writer outside that
  stream (a decode's KV receiver) gets the page only once the copy's event completed (the allocator's
  `read_by`);
- loads (host -> device): the side stream waits for the compute stream (the fresh pages may have
  been written by queued work) and copies; the load's event says when the pages hold the KV. Only the
  requests that need those pages wait for it (`KVCache.waits_for_load`); other steps keep running.
A host page being loaded is pinned (not evicted from the host pool) until its load's event completed.
On the CPU every copy is a plain memcpy done at once: no events, nothing pending.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv_pool import page_bytes_view, page_index
from splitserve.engine.page_events import HOST, PageEvents


@dataclass(eq=False)
class PendingLoad:
    """Host pages on their way into device pages (CUDA): done once `event` has completed."""

    event: torch.cuda.Event
    slots: list[int]
    started: float
    done: bool = False
    nodes: list = field(default_factory=list)  # the prefix-tree nodes whose pages it fills

    def ready(self) -> bool:
        return self.done or self.event.query()


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(host slot, staged row) pairs grouped into runs of consecutive slots and rows: (slot, row, length)."""
    runs: list[tuple[int, int, int]] = []
    for slot, row in pairs:
        if runs and runs[-1][0] + runs[-1][2] == slot and runs[-1][1] + runs[-1][2] == row:
            s, r, n = runs[-1]
            runs[-1] = (s, r, n + 1)
        else:
            runs.append((slot, row, 1))
    return runs


class HostKVPool:
    """`capacity` pages of host memory holding KV pages of the device pool `device_buffer`
    ([layers, 2, pages, page_size, kv_heads, head_dim]), by page hash, least recently used out first."""

    def __init__(self, device_buffer: torch.Tensor, capacity: int, events: PageEvents | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"the host KV pool needs at least one page, got {capacity}")
        device_buffer = page_bytes_view(device_buffer)  # an FP8 pool's pages move as bytes
        self.device_buffer: torch.Tensor | None = device_buffer
        layers, two, _, page_size, heads, dim = device_buffer.shape
        self.page_shape = (layers, two, page_size, heads, dim)
        self.cuda = device_buffer.device.type == "cuda"
        self.buffer = torch.empty((capacity, *self.page_shape), dtype=device_buffer.dtype,
                                  pin_memory=self.cuda)
        self.capacity = capacity
        self.events = events  # the host tier's pages, reported as the "host" tier (routers count them as held)
        self.page_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self._index: OrderedDict[int, int] = OrderedDict()  # page hash -> host slot, least recent first
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: dict[int, int] = {}  # host slot -> loads reading it now
        self.pending: list[PendingLoad] = []
        if self.cuda:
            self._write_stream = torch.cuda.Stream(device_buffer.device)
            self._load_stream = torch.cuda.Stream(device_buffer.device)
        # Counters for /metrics (the engine publishes their growth).
        self.written_pages = 0
        self.loaded_pages = 0
        self.hit_tokens = 0
        self.load_seconds: list[float] = []  # load latencies not yet published

    # ---- lookups ---------------------------------------------------------------------------

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._index

    @property
    def held(self) -> int:
        """Pages held now (never more than `capacity`)."""
        return len(self._index)

    @property
    def held_bytes(self) -> int:
        return self.held * self.page_bytes

    def pin(self, hashes: Sequence[int]) -> list[int]:
        """The host slots of `hashes` (all held), pinned: not evicted until `unpin`; marked recently used."""
        slots = []
        for h in hashes:
            slot = self._index[h]
            self._index.move_to_end(h)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            left = self._pins[slot] - 1
            if left:
                self._pins[slot] = left
            else:
                del self._pins[slot]

    # ---- device -> host ----------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._index.items():  # least recently used first
            if slot not in self._pins:
                del self._index[h]
                if self.events is not None:
                    self.events.removed(h, HOST)
                return slot
        return None  # every page is being loaded: nothing to give up

    def write_back(self, evicted: Sequence[tuple[int, int]]) -> tuple[torch.cuda.Event, ...]:
        """Copies evicted device pages, (page hash, device page) pairs, to the host: those whose hash
        is not here yet (the others are only marked recently used). Returns the event recorded after the
        copy that reads the device pages (CUDA; none on the CPU, where the copy is done on return, or where
        nothing was copied)."""
        buf = self.device_buffer
        if buf is None:
            return ()
        copies: list[tuple[int, int]] = []  # (host slot, device page)
        for h, page in evicted:
            if h in self._index:
                self._index.move_to_end(h)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._index[h] = slot
            if self.events is not None:
                self.events.stored(h, HOST)
            copies.append((slot, page))
        if not copies:
            return ()
        self.written_pages += len(copies)
        copies.sort()
        slots = [s for s, _ in copies]
        if not self.cuda:
            idx = torch.tensor([p for _, p in copies], dtype=torch.int64)
            self.buffer.index_copy_(0, torch.tensor(slots, dtype=torch.int64), buf.index_select(2, idx).movedim(2, 0))
            return ()
        main = torch.cuda.current_stream(buf.device)
        self._write_stream.wait_stream(main)
        with torch.cuda.stream(self._write_stream):
            idx = page_index([p for _, p in copies], buf.device)
            staged = buf.index_select(2, idx).movedim(2, 0).contiguous()  # [n, layers, 2, ...]
            for slot, row, n in _runs([(s, i) for i, s in enumerate(slots)]):
                self.buffer[slot:slot + n].copy_(staged[row:row + n], non_blocking=True)
            written = torch.cuda.Event()
            written.record()
        main.wait_event(written)  # the evicted pages are not rewritten before they are read (by this engine's steps)
        return (written,)

    # ---- host -> device ----------------------------------------------------------------------

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> PendingLoad | None:
        """Copies pinned host `slots` into device `pages`, one each. On the CPU the copy is done and the
        slots unpinned on return (None); on CUDA the returned load unpins them once `reap` sees it done."""
        buf = self.device_buffer
        assert buf is not None and len(slots) == len(pages)
        self.loaded_pages += len(pages)
        started = time.monotonic()
        if not self.cuda:
            rows = self.buffer.index_select(0, torch.tensor(list(slots), dtype=torch.int64))
            buf.index_copy_(2, torch.tensor(list(pages), dtype=torch.int64), rows.movedim(0, 2))
            self.unpin(slots)
            self.load_seconds.append(time.monotonic() - started)
            return None
        main = torch.cuda.current_stream(buf.device)
        self._load_stream.wait_stream(main)
        with torch.cuda.stream(self._load_stream):
            staged = torch.empty((len(slots), *self.page_shape), dtype=buf.dtype, device=buf.device)
            for slot, row, n in _runs(list(zip(slots, range(len(slots)), strict=True))):
                staged[row:row + n].copy_(self.buffer[slot:slot + n], non_blocking=True)
            idx = page_index(list(pages), buf.device)
            buf.index_copy_(2, idx, staged.movedim(0, 2))
            event = torch.cuda.Event()
            event.record()
        load = PendingLoad(event, list(slots), started)
        self.pending.append(load)
        return load

    def reap(self) -> list[PendingLoad]:
        """Loads completed since the last call: their slots unpinned, their latencies noted."""
        if not self.pending:
            return []
        done, still = [], []
        for load in self.pending:
            if load.ready():
                load.done = True
                self.unpin(load.slots)
                self.load_seconds.append(time.monotonic() - load.started)
                done.append(load)
            else:
                still.append(load)
        self.pending = still
        return done

    def fence(self) -> None:
        """The compute stream waits for every load in flight (before it reads a page one may fill)."""
        if self.pending and self.device_buffer is not None:
            main = torch.cuda.current_stream(self.device_buffer.device)
            for load in self.pending:
                main.wait_event(load.event)

    def clear(self) -> int:
        """Forgets every page not being loaded now; returns how many."""
        dropped = [h for h, slot in self._index.items() if slot not in self._pins]
        for h in dropped:
            self._free.append(self._index.pop(h))
            if self.events is not None:
                self.events.removed(h, HOST)
        return len(dropped)

    def close(self) -> None:
        """Lets go of the device pool (the engine stopped: its memory goes back)."""
        if self.cuda and self.device_buffer is not None:
            torch.cuda.synchronize(self.device_buffer.device)
        self.device_buffer = None
        self.pending = []
