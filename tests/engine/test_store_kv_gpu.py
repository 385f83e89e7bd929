"""The store tier on a CUDA device: write-throughs staged on a side stream (against steps queued on the
compute stream) and loads queued on the compute stream keep every page's KV, between two caches of
one master, with and without a host tier."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.store")

from splitserve.engine.host_kv import HostKVPool
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.page_hash import page_hashes
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.store_kv import StoreKV, start_master

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE = 16


def fill(kv: KVCache, pool: KVPool, req: Request) -> None:
    """A slow step on the compute stream writes each of `req`'s computed pages with its hash's value."""
    assert kv.grow(req, len(req.prompt_ids))
    torch.cuda._sleep(2_000_000)  # the staging copy must wait for this, not race it
    for i, h in enumerate(page_hashes(req.prompt_ids, PAGE)):
        if i * PAGE >= req.cached_len:
            pool.buffer[:, :, req.pages[i]] = float(h % 100_003)
    req.kv_len = len(req.prompt_ids)


def cache(address: str, host_pages: int) -> tuple[KVCache, KVPool, StoreKV]:
    dev = torch.device("cuda")
    pool = KVPool(KVPoolShape(num_layers=4, num_pages=17, page_size=PAGE, num_kv_heads=8, head_dim=128,
                              dtype=torch.float32), dev)
    store = StoreKV(pool.buffer, address, "gpu/test", segment_bytes=256 << 20, buffer_bytes=64 << 20, timeout_s=5.0)
    assert store.buffer.is_pinned()
    host = HostKVPool(pool.buffer, host_pages) if host_pages else None
    kv = KVCache(17, PAGE, 2, max_context=1024, device=dev, copy_page=pool.copy_page, host=host, store=store)
    deadline = time.monotonic() + 60
    while not store.ready:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return kv, pool, store


@pytest.mark.parametrize("host_pages", [0, 8], ids=["no-host-tier", "small-host-tier"])
def test_pages_written_through_on_cuda_are_loaded_by_another_cache_with_their_kv(host_pages: int) -> None:
    master, address = start_master()
    kv1, pool1, store1 = cache(address, host_pages)
    kv2, pool2, store2 = cache(address, host_pages)
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 250, (PAGE * 12,), generator=gen).tolist() for _ in range(4)]
        for i, p in enumerate(prompts):  # each evicts (writes through) the one before, rewriting its pages at once
            req = Request(f"a{i}", [*p, 0], SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
            kv1.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
            fill(kv1, pool1, req)
            kv1.release(req)
        torch.cuda.synchronize()
        deadline = time.monotonic() + 20
        while store1.jobs_pending():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert store1.written_pages >= 2 * 12  # the first two prompts whole (the third's first pages stay)
        for i, p in enumerate(prompts[:2]):
            req = Request(f"b{i}", [*p, 1], SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
            kv2.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
            while kv2.waits_for_load(req):
                kv2.reap_loads()
            assert req.cached_len == PAGE * 12, f"prompt {i}"
            for j, h in enumerate(page_hashes(p, PAGE)):
                got = pool2.buffer[:, :, req.pages[j]]
                assert torch.all(got == float(h % 100_003)), f"prompt {i} page {j}"
            fill(kv2, pool2, req)  # evicts the pages just loaded (and rewrites them)
            kv2.release(req)
        torch.cuda.synchronize()
        assert store2.hit_tokens >= 2 * 12 * PAGE and store1.failures == store2.failures == 0
    finally:
        store1.close()
        store2.close()
        master.kill()
        master.wait()
