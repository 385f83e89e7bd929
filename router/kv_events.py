"""Keeps the prefix index current: polls each backend's `/internal/kv_events` for the page hashes its prefix
cache gained and evicted, and fetches the tokenizer of each tokenizer digest the backends report.

A backend that answers 404 publishes no events (an engine of another version): the index knows it by the
prompts sent to it (approximate mode), and it is asked again now and then. A failed poll keeps what the
index had; the next one continues from the same sequence number (or gets a reset).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.prompt_pages import PromptTokenizer
from splitserve.transfer.bootstrap_grant import KEY_HEADER

logger = logging.getLogger(__name__)


class KVEventsPoller:
    """Polls every backend of the routed pools; one round every `interval_s`."""

    def __init__(self, index: PrefixIndex, client: httpx.AsyncClient, urls: Callable[[], list[str]], key: str,
                 interval_s: float, timeout_s: float = 2.0, unsupported_retry_s: float = 30.0) -> None:
        self.index, self.client, self.urls = index, client, urls
        self.headers = {KEY_HEADER: key} if key else {}
        self.interval_s, self.timeout_s, self.unsupported_retry_s = interval_s, timeout_s, unsupported_retry_s
        self.page_size: dict[str, int] = {}  # url -> its page size, from its events
        self.tokenizer_digest: dict[str, str] = {}  # url -> the digest of its tokenizer
        self.tokenizers: dict[str, PromptTokenizer] = {}  # digest -> tokenizer
        self._unsupported_until: dict[str, float] = {}
        self._known: set[str] = set()

    async def poll(self, url: str) -> None:
        loop = asyncio.get_running_loop()
        if self._unsupported_until.get(url, 0.0) > loop.time():
            return
        epoch, seq = self.index.cursor(url)
        params: dict[str, Any] = {"seq": seq, **({"epoch": epoch} if epoch else {})}
        try:
            r = await self.client.get(f"{url}/internal/kv_events", params=params, headers=self.headers,
                                      timeout=self.timeout_s)
            if r.status_code == 404:
                if url not in self._unsupported_until:
                    logger.info("%s publishes no KV events: routing to it by what was sent there", url)
                self._unsupported_until[url] = loop.time() + self.unsupported_retry_s
                return
            r.raise_for_status()
            answer = r.json()
            self.index.apply_events(url, answer)
            self.page_size[url] = int(answer["page_size"])
            if url not in self.tokenizer_digest:
                await self._fetch_tokenizer(url)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.debug("KV events of %s: %s: %s", url, type(exc).__name__, exc)

    async def _fetch_tokenizer(self, url: str) -> None:
        r = await self.client.get(f"{url}/internal/tokenizer", headers=self.headers, timeout=30.0)
        r.raise_for_status()
        parts = r.json()
        digest = parts["digest"]
        if digest not in self.tokenizers:
            # Building it parses a tokenizer.json of a few MB: off the event loop.
            self.tokenizers[digest] = await asyncio.to_thread(PromptTokenizer, parts)
            logger.info("tokenizer %s (from %s) for cache-aware routing", digest, url)
        self.tokenizer_digest[url] = digest

    async def poll_all(self) -> None:
        urls = set(self.urls())
        for gone in self._known - urls:
            self.index.forget(gone)
            self.page_size.pop(gone, None)
            self.tokenizer_digest.pop(gone, None)
        self._known = urls
        await asyncio.gather(*(self.poll(u) for u in urls))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_all()
            except Exception:  # a round must never end the loop
                logger.exception("KV events round failed")
            await asyncio.sleep(self.interval_s)
