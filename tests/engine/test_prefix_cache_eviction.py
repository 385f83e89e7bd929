"""The prefix cache's eviction list: after any sequence of matches, inserts, extensions, locks, unlocks and
evictions, the leaves it lists are exactly the unlocked leaves of the tree, and an eviction takes the least
recently used of them first (leaf by leaf, a parent once its last child is gone), as a walk over the whole tree
would choose."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.prefix_cache import PrefixCache, TreeNode

PAGE = 4


def unlocked_leaves(cache: PrefixCache) -> set[TreeNode]:
    return {n for n in cache.leaves() if n.lock_ref == 0}


def least_recently_used(cache: PrefixCache) -> TreeNode:
    return min(unlocked_leaves(cache), key=lambda n: n.last_access)


@pytest.mark.parametrize("seed", range(6))
def test_the_listed_leaves_are_the_unlocked_leaves_and_eviction_is_least_recently_used(seed: int) -> None:
    rng = random.Random(seed)
    allocator = PageAllocator(200)
    cache = PrefixCache(PAGE, allocator)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 6) * PAGE)] for _ in range(6)]
    held: list[TreeNode] = []  # locked paths, as running requests hold them
    for _ in range(400):
        op = rng.random()
        tokens = rng.choice(prefixes)[: rng.randrange(1, 6) * PAGE] + [rng.randrange(5) for _ in range(
            rng.randrange(0, 3 * PAGE))]
        if op < 0.35:  # a finished request's pages go in (partial last page kept or not)
            pages = allocator.alloc(-(-len(tokens) // PAGE)) if allocator.free_count * PAGE >= len(tokens) else None
            if pages is not None:
                leftover, _ = cache.insert(tokens, pages, keep_partial=rng.random() < 0.3)
                allocator.free(leftover)
        elif op < 0.55:  # an admission: match (at most some of its tokens, as admission keeps one) and lock
            match = cache.match(tokens, rng.choice([None, max(len(tokens) - 1, 0), PAGE]))
            cache.lock(match.node)
            held.append(match.node)
        elif op < 0.65 and held:  # a request computes further pages past its locked prefix
            node = held[rng.randrange(len(held))]
            if not node.children and allocator.free_count >= 2 and node.key and len(node.key) == PAGE:
                chunks = [tuple(rng.randrange(5) for _ in range(PAGE)) for _ in range(2)]
                pages = allocator.alloc(2)
                deeper = cache.extend(node, chunks, pages)
                hung = {n.page for n in (deeper, deeper.parent) if n is not None}
                allocator.free([p for p in pages if p not in hung])  # a chunk cached with another page: ours
                cache.lock(deeper)
                cache.unlock(node)
                held[held.index(node)] = deeper
        elif op < 0.85 and held:  # a request ends
            cache.unlock(held.pop(rng.randrange(len(held))))
        else:  # eviction, checked page by page against the tree walk
            for _ in range(rng.randrange(1, 8)):
                if not unlocked_leaves(cache):
                    assert cache.evict(1) == 0
                    break
                want = least_recently_used(cache)
                ties = {n for n in unlocked_leaves(cache) if n.last_access == want.last_access}
                before = set(cache.leaves()) | {n.parent for n in cache.leaves()}
                assert cache.evict(1) == 1
                after = set(cache.leaves()) | {n.parent for n in cache.leaves()}
                gone = [n for n in ties if n.parent is None or n.key not in n.parent.children]
                assert len(gone) == 1 and gone[0] in before and gone[0] not in after
        assert cache.listed_leaves == unlocked_leaves(cache)
        assert len(cache._lru) <= 2 * len(cache.listed_leaves) + 64  # stale entries are dropped as they pile up
    for node in held:
        cache.unlock(node)
    cache.flush()
    assert allocator.free_count == allocator.capacity
    assert cache.cached_pages == 0 and cache.listed_leaves == set() and cache.leaves() == []
