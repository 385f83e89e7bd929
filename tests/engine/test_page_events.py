"""Page hashes and the events that publish them: the prefix cache's full pages carry the hash a router
computes from the same token ids, each stored and evicted page is an event, and a reader that restarted
or fell behind gets the whole set instead of a gap."""

from __future__ import annotations

import httpx
import pytest
from servers import free_port

from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.page_events import PageEvents
from splitserve.engine.page_hash import next_hash, page_hashes, root_hash
from splitserve.engine.prefix_cache import PrefixCache


def held_after(answer: dict, held: set[int] | None = None) -> set[int]:
    """A reader's view: the set of hashes after applying an answer."""
    held = set() if answer["reset"] or held is None else set(held)
    for op, tier, hashes in answer["events"]:
        assert tier == "device"
        (held.update if op == "stored" else held.difference_update)(hashes)
    return held


def test_page_hashes_chain_the_whole_prefix_and_depend_on_the_page_size() -> None:
    ids = list(range(40))
    hashes = page_hashes(ids, 8)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    assert hashes[0] == next_hash(root_hash(8), ids[:8]) and hashes[1] == next_hash(hashes[0], ids[8:16])
    assert page_hashes(ids[:20], 8) == hashes[:2]  # a prefix's pages hash alike
    assert page_hashes([99, *ids[1:]], 8)[4] != hashes[4]  # the first token changes every later page
    assert page_hashes(ids, 4)[1] != hashes[0]
    assert all(0 <= h < 1 << 64 for h in hashes)
    assert page_hashes([-5, -5, 3, 4], 2)  # an image's cache key (negative) hashes like any id


def test_the_prefix_cache_reports_the_hashes_of_pages_it_gains_and_evicts() -> None:
    events = PageEvents(page_size=4)
    allocator = PageAllocator(16)
    cache = PrefixCache(4, allocator, events=events)
    prompt = list(range(100, 114))  # 3 full pages and 2 tokens
    pages = allocator.alloc(4)
    leftover, _ = cache.insert(prompt, pages, keep_partial=True)
    assert leftover == []
    seen = events.since(None, 0)
    assert seen["reset"] and held_after(seen) == set(page_hashes(prompt, 4))  # the partial page has no hash
    other = [*prompt[:8], 7, 7, 7, 7]
    duplicates, _ = cache.insert(other, allocator.alloc(3))
    allocator.free(duplicates)  # its first two pages were cached already
    update = events.since(seen["epoch"], seen["seq"])
    assert not update["reset"] and update["events"] == [["stored", "device", [page_hashes(other, 4)[2]]]]
    held = held_after(update, held_after(seen))
    assert cache.evict(16) == len(held) + 1  # and the partial leaf, which has no hash
    gone = events.since(update["epoch"], update["seq"])
    assert held_after(gone, held) == set() and events.held == 0
    assert allocator.free_count == allocator.capacity


def test_a_reader_of_another_epoch_or_behind_the_log_gets_a_reset() -> None:
    events = PageEvents(page_size=2, max_log=4)
    for h in range(10):
        events.stored(h)
    events.removed(3)
    fresh = events.since("an-old-epoch", 5)
    assert fresh["reset"] and held_after(fresh) == set(range(10)) - {3}
    assert events.since(events.epoch, 1)["reset"]  # fell behind the trimmed log
    assert events.since(events.epoch, 99)["reset"]  # a sequence number from the future
    recent = events.since(events.epoch, events.since(None, 0)["seq"] - 1)
    assert not recent["reset"] and recent["events"] == [["removed", "device", [3]]]


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True])
def test_an_engine_publishes_the_hashes_of_a_served_prompt(start_server, engine_process: bool) -> None:
    port = free_port()
    args = ["serve", "--model", "tiny", "--device", "cpu", "--port", str(port), "--page-size", "4",
            "--transfer-control-key", "k" * 16, *(["--engine-process"] if engine_process else [])]
    start_server(args, health_url=f"http://127.0.0.1:{port}/health")
    base = f"http://127.0.0.1:{port}"
    headers = {"x-splitserve-key": "k" * 16}
    empty = httpx.get(f"{base}/internal/kv_events", headers=headers, timeout=30).json()
    assert empty["page_size"] == 4 and empty["reset"] and held_after(empty) == set()
    assert httpx.get(f"{base}/internal/kv_events", timeout=30).status_code == 401
    assert httpx.get(f"{base}/internal/kv_events?seq=x", headers=headers, timeout=30).status_code == 400
    prompt = list(range(10, 31))  # 5 full pages and a token
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    update = httpx.get(f"{base}/internal/kv_events", headers=headers, timeout=30,
                       params={"epoch": empty["epoch"], "seq": empty["seq"]}).json()
    assert not update["reset"]
    assert set(page_hashes(prompt, 4)) <= held_after(update)
