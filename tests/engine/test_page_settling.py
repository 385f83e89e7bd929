"""KV pages freed while a step is queued on the device settle when it completes, and a writer outside the engine's
stream (a decode's KV receiver, into whose pages a prefill copies from another process) is given settled pages
only. Under the overlap scheduler a request that ends in step k's results still has a row in step k+1, already
queued, which writes its next token's KV into its tail page; that page, freed at once, must not go to a receiver
whose prefill may copy into it before step k+1 runs.

The allocator alone, then the engine with the overlap scheduler forced on and the device slowed (each step's
result ready `STEP_S` after its launch: tests/slow_device.py), with a role that reserves pages as a decode does
for requests it parks."""

from __future__ import annotations

import threading
import time

import pytest
from slow_device import slow_down

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.page_allocator import DoubleFreeError, OutOfPagesError, PageAllocator
from splitserve.engine.request import FinishReason, Request, TokenOutput
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

STEP_S = 0.04
RECEIVED = 7  # prompts starting with this token are parked and given pages as a decode's receiver would be
FILLS_PAGES = 28  # pages of the prompt that fills the prefix cache before the reservations begin


def test_pages_freed_while_a_step_is_queued_settle_when_it_completes() -> None:
    alloc = PageAllocator(9)  # pages 1..8
    first = alloc.alloc(4)
    alloc.step_launched(1)
    alloc.free(first[:2])  # step 1 may still write these
    assert alloc.free_count == 6 and alloc.settled_count == 4
    with pytest.raises(OutOfPagesError, match="settled"):
        alloc.alloc(5, settled_only=True)
    settled = alloc.alloc(4, settled_only=True)
    assert not set(settled) & set(first[:2])
    alloc.free(settled)
    alloc.step_launched(2)  # overlap: step 2 queued before step 1 completes
    alloc.step_completed(1)
    assert alloc.settled_count == 2 + 4  # step 1's pages, and the ones freed while it was still queued
    alloc.free(first[2:])  # while step 2 is queued
    assert alloc.settled_count == 6 and alloc.free_count == 8
    with pytest.raises(DoubleFreeError):
        alloc.free(first[2:3])  # settling pages are free: freeing one again is still a bookkeeping bug
    # The engine's own steps run after step 2 on its stream: its allocations take the settling pages first.
    mine = alloc.alloc(1)
    assert mine[0] in first[2:] and alloc.settled_count == 6
    alloc.step_completed(2)
    assert alloc.settled_count == alloc.free_count == 7
    alloc.free(mine)  # no step in flight: settled at once
    assert alloc.settled_count == 8


def test_an_evicted_page_settles_unless_the_step_in_flight_when_it_was_cached_still_runs() -> None:
    alloc = PageAllocator(9)
    old, recent = alloc.alloc(2), alloc.alloc(2)
    alloc.note_written(old)  # cached with no step in flight
    alloc.step_launched(1)
    alloc.note_written(recent)  # its request ended with a row in step 1
    alloc.free(old, cached=True)  # evicted while step 1 runs: nothing queued writes it
    alloc.free(recent, cached=True)
    assert alloc.settled_count == 4 + 2 and alloc.free_count == 8
    alloc.step_completed(1)
    assert alloc.settled_count == 8


class CopyInFlight:
    """A side-stream copy still reading pages, as the CUDA event recorded after it reports (this machine has no
    GPU: tests/engine/test_host_kv_gpu.py has the real write-back)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_page_a_write_back_still_reads_goes_to_the_engine_but_not_to_a_receiver() -> None:
    alloc = PageAllocator(9)
    spilled, written = alloc.alloc(2), alloc.alloc(2)
    copy = CopyInFlight()
    alloc.free(spilled, cached=True, read_by=(copy,))
    assert alloc.free_count == 6 and alloc.settled_count == 4
    with pytest.raises(OutOfPagesError, match="settled"):
        alloc.alloc(5, settled_only=True)
    mine = alloc.alloc(1)  # the engine's stream waits for the copy: its own allocations may take them
    assert mine[0] in spilled and alloc.settled_count == 4
    alloc.free(mine)  # given back before the copy is done: it still waits for it
    assert alloc.settled_count == 4 and alloc.reading_count == 2
    copy.done = True
    assert alloc.settled_count == 6 and alloc.reading_count == 0
    # Read by a copy and cached while step 1 runs: settled once both are done, whichever ends last.
    alloc.note_written(written)
    alloc.step_launched(1)
    alloc.note_written(written)
    to_host, to_store = CopyInFlight(), CopyInFlight()
    alloc.free(written, cached=True, read_by=(to_host, to_store))
    to_host.done = to_store.done = True
    assert alloc.settled_count == 6  # step 1 may still write them
    alloc.step_launched(2)
    alloc.step_completed(1)
    assert alloc.settled_count == 8 and alloc.free_count == 8
    spilled = alloc.alloc(2)
    to_host, to_store = CopyInFlight(), CopyInFlight()
    alloc.free(spilled, cached=True, read_by=(to_host, to_store))
    to_host.done = True
    assert alloc.settled_count == 6  # the store's copy still reads them
    to_store.done = True
    assert alloc.settled_count == 8


def test_a_page_whose_copy_is_done_settles_with_its_step_whatever_was_freed_after_it() -> None:
    alloc = PageAllocator(9)
    spilled, own = alloc.alloc(1), alloc.alloc(1)
    alloc.step_launched(1)
    alloc.note_written(spilled)  # cached while step 1 runs
    copy = CopyInFlight()
    alloc.free(spilled, cached=True, read_by=(copy,))
    alloc.step_launched(2)
    alloc.free(own)  # step 2 may write it
    copy.done = True
    assert alloc.settled_count == 6  # the copy is done, step 1 is not
    alloc.step_completed(1)
    assert alloc.settled_count == 7  # step 1's page, though it joined the settling pages after step 2's
    alloc.step_completed(2)
    assert alloc.settled_count == alloc.free_count == 8


def test_a_page_a_host_load_still_fills_is_not_settled_when_evicted() -> None:
    """A request released while its load from the host tier runs leaves the loaded nodes evictable: evicted,
    their pages wait for the load as a write-back's wait for its copy."""
    from splitserve.engine.prefix_cache import PrefixCache

    alloc = PageAllocator(9)
    cache = PrefixCache(4, alloc)
    load = CopyInFlight()
    pages = alloc.alloc(2)
    _, node = cache.insert(list(range(8)), pages)
    cache.copy_in_flight = lambda n: load if n is node else None
    assert cache.evict(2) == 2
    assert alloc.free_count == 8 and alloc.settled_count == 7  # the loaded page waits, its parent does not
    load.done = True
    assert alloc.settled_count == 8


def test_a_decode_reservation_does_not_evict_again_for_pages_still_being_copied() -> None:
    """A receiver's pages must be settled; spilled pages settle once their copy is done. A reservation retried
    while the copy runs counts those pages as on their way instead of evicting more of the cache."""
    from splitserve.engine.kv_cache import KVCache

    kv = KVCache(17, 4, 4, max_context=64, device="cpu")
    copies: list[CopyInFlight] = []

    def spill(evicted: list[tuple[int, int]]) -> tuple[CopyInFlight, ...]:
        copies.append(CopyInFlight())
        return (copies[-1],)

    kv.prefix_cache.spill = spill
    for i in range(4):  # four cached prefixes of three full pages: 12 of the 16 pages
        pages = kv.allocator.alloc(3)
        kv.prefix_cache.insert([i * 100 + t for t in range(12)], pages)
    assert kv.allocator.settled_count == 4 and kv.prefix_cache.cached_pages == 12
    assert kv.take_pages(6, settled=True) is None  # two evicted, still being copied
    assert kv.prefix_cache.cached_pages == 10 and len(copies) == 1
    assert kv.take_pages(6, settled=True) is None  # the retry waits for them
    assert kv.prefix_cache.cached_pages == 10 and len(copies) == 1
    copies[0].done = True
    got = kv.take_pages(6, settled=True)
    assert got is not None and len(got) == 6 and kv.prefix_cache.cached_pages == 10


def test_the_prefix_cache_frees_its_spilled_pages_as_read_by_the_write_back() -> None:
    """Evicted full pages go to the lower tier by a copy that may still run: they are not settled until it is
    done; the partial tail evicted with them (not spilled) settles at once."""
    from splitserve.engine.prefix_cache import PrefixCache

    alloc = PageAllocator(9)
    cache = PrefixCache(4, alloc)
    copies: list[CopyInFlight] = []
    spilled: list[tuple[int, int]] = []

    def spill(evicted: list[tuple[int, int]]) -> tuple[CopyInFlight, ...]:
        spilled.extend(evicted)
        copies.append(CopyInFlight())
        return (copies[-1],)

    cache.spill = spill
    pages = alloc.alloc(3)
    owned, _ = cache.insert(list(range(10)), pages, keep_partial=True)  # two full pages and a tail of 2
    assert owned == []
    assert cache.evict(3) == 3
    assert sorted(p for _, p in spilled) == sorted(pages[:2])
    assert alloc.free_count == 8 and alloc.settled_count == 8 - 2  # the tail settled, the spilled pages not yet
    copies[0].done = True
    assert alloc.settled_count == 8


class ReservesLikeADecode(Role):
    """Parks requests whose prompt starts with RECEIVED and, from its poll, gives each its prompt's pages as the
    decode role does (settled ones, unless `settled` is off), noting which pages were settling at that moment;
    then ends it (its KV "arrived" and was not needed)."""

    def __init__(self, settled: bool) -> None:
        self.settled = settled
        self.parked: list[Request] = []
        self.reserved: list[tuple[set[int], set[int]]] = []  # (pages given, pages settling then)
        self.evictions = 0  # reservations that evicted cached pages
        self.refused = 0  # reservations put off to a later poll for want of settled pages

    def on_arrival(self, req: Request) -> bool:
        if req.prompt_ids[0] != RECEIVED:
            return False
        self.engine.park(req)
        self.parked.append(req)
        return True

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.parked else None

    def poll(self) -> None:
        kv = self.engine.kv
        while self.parked:
            req = self.parked[0]
            settling = {page for _, page in kv.allocator._settling}
            cached = kv.prefix_cache.cached_pages
            kv.admit(req, max_prefix_tokens=0)
            grown = kv.grow(req, len(req.prompt_ids), settled=self.settled)
            self.evictions += kv.prefix_cache.cached_pages < cached
            if not grown:
                self.refused += 1
                kv.release(req)
                return
            self.parked.pop(0)
            self.reserved.append((set(req.pages), settling))
            self.engine.finish(req, FinishReason.STOP)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["freed", "cached-then-evicted"])
@pytest.mark.parametrize("settled", [True, False], ids=["settled", "any-free-page"])
def test_a_receiver_never_gets_a_page_that_a_queued_step_may_write(settled: bool, prefix_cache: bool) -> None:
    """With the prefix cache on, an ended request's pages go to the cache and the reservation evicts them."""
    role = ReservesLikeADecode(settled)
    # With the cache on, a KV cache small enough that reservations evict what ended requests left in it.
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=128 if prefix_cache
                                 else 512, max_running_requests=16, disable_prefix_cache=not prefix_cache),
                    role=ComposedRole("decode", [role]))
    slow_down(engine, STEP_S)
    ended = threading.Semaphore(0)

    def on_output(out: TokenOutput) -> None:
        if out.finish_reason is not None:
            ended.release()

    engine.start()
    submitted = 0
    try:
        if prefix_cache:
            # Fill the cache (28 of the 32 pages) before any reservation, and make the first reservation need
            # more pages than can then be free: at least one reservation evicts, however the steps are timed.
            engine.submit(Request("fills-the-cache", list(range(100, 100 + FILLS_PAGES * 4)),
                                  SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True), on_output))
            assert ended.acquire(timeout=30)
            assert engine.kv.prefix_cache.cached_pages >= FILLS_PAGES
        for i in range(24):
            # Short requests end in one step's results while their row is in the next one, already queued.
            engine.submit(Request(f"short-{i}", [10 + i, 40 + i, 8, 9, 10, 11, 12, 13, 14][: 2 + i % 8],
                                  SamplingParams(max_new_tokens=1 + i % 3, temperature=0.0, ignore_eos=True),
                                  on_output))
            received = [RECEIVED, *range(1, 20)] if i == 0 else [RECEIVED, 1, 2, 3, 4][: 2 + i % 4]
            engine.submit(Request(f"received-{i}", received,
                                  SamplingParams(max_new_tokens=1, temperature=0.0), on_output))
            submitted += 2
            time.sleep(STEP_S / 2)
        for _ in range(submitted):
            assert ended.acquire(timeout=30)
        time.sleep(3 * STEP_S)
    finally:
        engine.stop()
    overlapping = [pages & settling for pages, settling in role.reserved if pages & settling]
    hazards = sum(1 for _, settling in role.reserved if settling)
    assert len(role.reserved) == 24 and hazards > 0, "no reservation met a page freed while a step was queued"
    assert role.evictions > 0 or not prefix_cache, "no reservation evicted a cached page"
    if settled and prefix_cache:
        # Cached pages evicted while a step runs are settled unless cached during it: no reservation waits a poll
        # for them (stamped with the step in flight at eviction, every eviction put its reservation off).
        assert role.refused == 0, (role.refused, role.evictions)
    if settled:
        assert not overlapping, f"a receiver got pages a queued step may still write: {overlapping}"
    else:  # what the test tells apart: the engine's newest-first reuse hands the ended request's page on
        assert overlapping
    alloc = engine.kv.allocator
    engine.kv.prefix_cache.flush()
    assert not alloc._settling and alloc.settled_count == alloc.capacity, "pages left settling or held"


def test_a_launch_that_fails_leaves_no_step_in_flight() -> None:
    """A launch that raises may have queued work before it did: the engine waits for the device, the step
    settles, and the failed request's pages are free and settled."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=512,
                                 max_running_requests=4, disable_prefix_cache=True))
    launch = engine.runner.launch
    calls = []

    def fails_once(chunks, page_table):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise RuntimeError("out of memory (a test's)")
        return launch(chunks, page_table)

    engine.runner.launch = fails_once
    outputs: list[TokenOutput] = []
    done = threading.Event()

    def on_output(out: TokenOutput) -> None:
        outputs.append(out)
        if out.finish_reason is not None:
            done.set()

    engine.start()
    try:
        engine.submit(Request("fails", [5, 6, 8, 9], SamplingParams(max_new_tokens=4, temperature=0.0), on_output))
        assert done.wait(30)
        done.clear()
        engine.submit(Request("runs", [5, 6, 8, 9], SamplingParams(max_new_tokens=4, temperature=0.0), on_output))
        assert done.wait(30)
    finally:
        engine.stop()
    assert outputs[0].finish_reason == FinishReason.ERROR and "engine step failed" in outputs[0].error
    assert outputs[-1].finish_reason is not FinishReason.ERROR
    alloc = engine.kv.allocator
    assert alloc._launched == alloc._completed == len(calls)
    assert not alloc._settling and alloc.settled_count == alloc.capacity
