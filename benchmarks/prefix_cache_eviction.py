"""The prefix cache's eviction with a full cache: what a decode step pays when its requests' pages come from
evicting cached prefixes.

  python3 -P benchmarks/prefix_cache_eviction.py [--pages 24714] [--sequences 1200] [--evictions 2000]

Fills a cache of `--pages` pages with `--sequences` finished requests of random lengths (shared prefixes
among them), then evicts one page at a time, as the scheduler grows each running request by a page. Times
each eviction with the cache's listed leaves, and against the same choice made by a walk over the whole tree
(the least recently used unlocked leaf, found by visiting every node), measured in the same run.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import random
import statistics
import time

from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)
PAGE = 16


def filled_cache(pages: int, sequences: int, seed: int) -> PrefixCache:
    rng = random.Random(seed)
    allocator = PageAllocator(pages + 1)
    cache = PrefixCache(PAGE, allocator)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(8, 64) * PAGE)] for _ in range(32)]
    for _ in range(sequences):
        own = rng.randrange(4, 2048 // PAGE) * PAGE
        tokens = rng.choice(prefixes)[: rng.randrange(1, 8) * PAGE] + [rng.randrange(32000) for _ in range(own)]
        need = len(tokens) // PAGE
        if allocator.free_count < need:
            break
        leftover, _ = cache.insert(tokens, allocator.alloc(need))
        allocator.free(leftover)
    return cache


def walk_choice(cache: PrefixCache) -> int:
    """The page a walk over the whole tree evicts next (the cost paid before the listing)."""
    heap = [(n.last_access, id(n), n) for n in cache.leaves() if n.lock_ref == 0]
    heapq.heapify(heap)
    return heap[0][2].page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=24714, help="cache pages (an 8B model's on an H100: 24,714)")
    parser.add_argument("--sequences", type=int, default=1200, help="finished requests cached")
    parser.add_argument("--evictions", type=int, default=2000, help="single-page evictions timed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cache = filled_cache(args.pages, args.sequences, args.seed)
    leaves = len(cache.leaves())
    walked, listed = [], []
    for _ in range(args.evictions):
        start = time.perf_counter()
        want = walk_choice(cache)
        walked.append(time.perf_counter() - start)
        free_before = cache.allocator.free_count
        start = time.perf_counter()
        cache.evict(1)
        listed.append(time.perf_counter() - start)
        assert cache.allocator.free_count == free_before + 1
        assert want not in {n.page for n in cache.leaves()}, "the listing chose another leaf than the walk"
    walk_us, list_us = statistics.median(walked) * 1e6, statistics.median(listed) * 1e6
    logger.info("cache of %d pages, %d cached, %d leaves; %d single-page evictions", args.pages,
                cache.cached_pages + args.evictions, leaves, args.evictions)
    logger.info("eviction, median: listed leaves %.1f us, walk over the tree %.0f us: %.0fx faster", list_us,
                walk_us, walk_us / list_us)
    logger.info("a decode step of 256 requests growing by a page every 16 tokens (16 evictions): %.2f ms "
                "against %.1f ms", 16 * list_us / 1e3, 16 * walk_us / 1e3)


if __name__ == "__main__":
    main()
