"""The host KV tier on a CUDA device: write-backs and loads on their side streams keep every page's KV
(against steps queued on the compute stream), and greedy output is the same with the tier and without."""

from __future__ import annotations

import pytest
import torch
from multi_turn import multi_turn_prompts

from splitserve.engine.host_kv import HostKVPool
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.page_hash import page_hashes
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE = 16


def fill(kv: KVCache, pool: KVPool, req: Request) -> None:
    """A step on the compute stream, slowed down, writes each of `req`'s computed pages with its hash's value."""
    assert kv.grow(req, len(req.prompt_ids))
    torch.cuda._sleep(2_000_000)  # the copies on the side streams must wait for this, not race it
    for i, h in enumerate(page_hashes(req.prompt_ids, PAGE)):
        if i * PAGE >= req.cached_len:
            pool.buffer[:, :, req.pages[i]] = float(h % 100_003)
    req.kv_len = len(req.prompt_ids)


def test_pages_survive_write_back_reuse_and_load_on_the_side_streams() -> None:
    dev = torch.device("cuda")
    pool = KVPool(KVPoolShape(num_layers=4, num_pages=17, page_size=PAGE, num_kv_heads=8, head_dim=128,
                              dtype=torch.float32), dev)
    host = HostKVPool(pool.buffer, 64)
    assert host.buffer.is_pinned()
    kv = KVCache(17, PAGE, 2, max_context=1024, device=dev, copy_page=pool.copy_page, host=host)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 250, (PAGE * 12,), generator=gen).tolist() for _ in range(4)]
    for rnd in range(3):
        for i, p in enumerate(prompts):
            req = Request(f"{rnd}-{i}", [*p, rnd], SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
            kv.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
            while kv.waits_for_load(req):
                kv.reap_loads()
            if rnd:  # its whole prompt was computed in an earlier round: found on the device or loaded from the host
                assert req.cached_len == PAGE * 12
                for j, h in enumerate(page_hashes(p, PAGE)):
                    got = pool.buffer[:, :, req.pages[j]]
                    assert torch.all(got == float(h % 100_003)), f"round {rnd} prompt {i} page {j}"
            fill(kv, pool, req)  # evicts (writes back) others' pages and rewrites them at once
            kv.release(req)
            u = kv.usage()
            assert u.free + u.cached == u.capacity and u.locked == 0
    torch.cuda.synchronize()
    kv.reap_loads()
    assert host.hit_tokens > 0 and not host._pins and not host.pending


def test_a_page_being_written_back_is_not_settled_until_its_copy_is_done() -> None:
    """The write-back reads an evicted page on a side stream queued behind the compute stream's work: the engine's
    own steps may take the page (they run after the copy), a KV receiver (another process's writer) may not until
    the copy's event completed."""
    dev = torch.device("cuda")
    pool = KVPool(KVPoolShape(num_layers=4, num_pages=17, page_size=PAGE, num_kv_heads=8, head_dim=128,
                              dtype=torch.float32), dev)
    kv = KVCache(17, PAGE, 2, max_context=1024, device=dev, copy_page=pool.copy_page, host=HostKVPool(pool.buffer, 64))
    prompt = list(range(1, PAGE * 8 + 2))
    req = Request("r", prompt, SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    fill(kv, pool, req)
    kv.release(req)
    torch.cuda.synchronize()
    settled, free = kv.allocator.settled_count, kv.allocator.free_count
    spilled: list[tuple[int, int]] = []
    write_back = kv.prefix_cache.spill
    assert write_back is not None

    def spill(evicted: list[tuple[int, int]]) -> tuple[torch.cuda.Event, ...]:
        spilled.extend(evicted)
        return write_back(evicted)

    kv.prefix_cache.spill = spill
    torch.cuda._sleep(200_000_000)  # about 0.1 s of queued work that the write-back's copy waits for
    assert kv.prefix_cache.evict(4) == 4
    assert spilled and kv.allocator.free_count == free + 4
    assert kv.allocator.settled_count == settled + 4 - len(spilled)  # a partial tail, not spilled, settles at once
    torch.cuda.synchronize()
    assert kv.allocator.settled_count == settled + 4


def greedy_run(rounds: list[list[list[int]]], params: SamplingParams, *, dtype: str, max_total_tokens: int,
               max_running_requests: int, host_kv_tokens: int, one_at_a_time: bool = False
               ) -> tuple[list[list[int]], float, float]:
    """The tiny model on CUDA over every round's prompts (a round at once, or one prompt after another): the
    outputs, the tokens loaded from the host tier and the prompt tokens computed."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens

    engine = Engine(EngineConfig(model="tiny", device="cuda", dtype=dtype, page_size=4,
                                 max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
                                 chunked_prefill_size=32, host_kv_tokens=host_kv_tokens))
    engine.start()
    try:
        batches = [[p] for prompts in rounds for p in prompts] if one_at_a_time else rounds
        outs = [out for prompts in batches for out in generate_tokens(engine, prompts, params, timeout=120)]
        reg = engine.metrics.registry
        hits = reg.get_sample_value("splitserve_host_kv_hit_tokens_total", {"model": "tiny"}) or 0.0
        computed = reg.get_sample_value("splitserve_prompt_tokens_computed_total", {"model": "tiny"})
        return outs, hits, computed
    finally:
        engine.stop()


def test_greedy_output_is_the_same_with_the_host_tier_on_cuda() -> None:
    rounds = multi_turn_prompts(seed=7)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    same = dict(dtype="float32", max_total_tokens=128, max_running_requests=2)
    plain, _, computed_off = greedy_run(rounds, params, host_kv_tokens=0, **same)
    tiered, hits, computed_on = greedy_run(rounds, params, host_kv_tokens=1024, **same)
    assert tiered == plain
    assert hits > 0 and computed_on < computed_off


def test_bf16_prefix_from_the_host_tier_is_the_prefix_from_device_memory() -> None:
    """In bfloat16 a prefix read from cache and one recomputed round differently (prompt and extend attention
    paths differ), so tier on against tier off compares a load with a recompute. What the tier owes is that its
    pages are the device's pages: one request at a time, a run whose prefixes come back from host memory gives
    the same tokens as a run whose device cache is roomy enough to keep them all."""
    rounds = multi_turn_prompts(seed=11)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    same = dict(dtype="bfloat16", max_running_requests=1, one_at_a_time=True)
    roomy, roomy_host_hits, roomy_computed = greedy_run(rounds, params, max_total_tokens=4096, host_kv_tokens=0,
                                                        **same)
    tiered, host_hits, tiered_computed = greedy_run(rounds, params, max_total_tokens=128, host_kv_tokens=1024,
                                                    **same)
    assert roomy_host_hits == 0 and host_hits > 0
    assert tiered_computed == roomy_computed  # the same prefixes hit in both runs, from different memories
    assert tiered == roomy
