"""The hash that names a full KV page by the whole prefix it ends: engines publish these for the pages their
prefix caches hold, routers look prompts up by them, and host or store tiers key pages by them.

A page's hash chains its parent's with its own token ids, so equal hashes mean equal prefixes (up to
collisions of a 64-bit digest), whichever engine computed them:

    h(root)   = blake2b("splitserve-pages-v1:" + page_size, 8 bytes)
    h(page i) = blake2b(h(page i-1) as 8 bytes little-endian + token ids of page i as int64 little-endian)

as unsigned 64-bit integers. Only full pages have hashes. An image's positions hold its cache key (a negative
id from the image's digest) instead of the placeholder token, so a prompt's pages after an image differ by
image. This module imports no torch: the router uses it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

VERSION = 1


def root_hash(page_size: int) -> int:
    """The hash a prompt's first page chains from, distinct per page size."""
    digest = hashlib.blake2b(f"splitserve-pages-v{VERSION}:{page_size}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def next_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of the page holding `tokens` after the prefix whose last page hashed to `parent`."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def page_hashes(ids: Sequence[int], page_size: int, max_pages: int | None = None) -> list[int]:
    """The hashes of the full pages of `ids` (at most `max_pages`), first page first."""
    n = len(ids) // page_size if max_pages is None else min(len(ids) // page_size, max_pages)
    hashes, parent = [], root_hash(page_size)
    for i in range(n):
        parent = next_hash(parent, ids[i * page_size:(i + 1) * page_size])
        hashes.append(parent)
    return hashes
