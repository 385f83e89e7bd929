"""The host-memory KV tier (--host-kv-tokens): evicted pages are written back by hash and loaded again,
the page counts always come back, the pool stays within its bound, and greedy output does not change."""

from __future__ import annotations

import time

import pytest
import torch
from multi_turn import multi_turn_prompts

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.host_kv import HostKVPool, PendingLoad
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.offline import generate_tokens
from splitserve.engine.page_hash import page_hashes
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig

PAGE = 4


def make_request(rid: str, prompt: list[int], max_new: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new), on_output=lambda _o: None)


def tiered_cache(pages: int = 9, host_pages: int = 16, slots: int = 2) -> tuple[KVCache, KVPool, HostKVPool]:
    pool = KVPool(KVPoolShape(num_layers=2, num_pages=pages, page_size=PAGE, num_kv_heads=1, head_dim=2,
                              dtype=torch.float32), torch.device("cpu"))
    host = HostKVPool(pool.buffer, host_pages)
    kv = KVCache(pages, PAGE, slots, max_context=256, device=torch.device("cpu"), copy_page=pool.copy_page,
                 host=host)
    return kv, pool, host


def page_value(page_hash: int) -> float:
    return float(page_hash % 100_003)


def compute(kv: KVCache, pool: KVPool, req: Request) -> None:
    """Stands in for the model: `req`'s whole prompt computed, each page filled with a value of its hash."""
    assert kv.grow(req, len(req.prompt_ids))
    for i, h in enumerate(page_hashes(req.prompt_ids, PAGE)):
        if i * PAGE >= req.cached_len:
            pool.buffer[:, :, req.pages[i]] = page_value(h)
    req.kv_len = len(req.prompt_ids)


def assert_all_back(kv: KVCache) -> None:
    u = kv.usage()
    assert u.locked == 0 and u.slots_in_use == 0
    assert u.free + u.cached == u.capacity
    assert kv.host is None or not kv.host._pins


def run_one(kv: KVCache, pool: KVPool, req: Request) -> None:
    kv.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
    compute(kv, pool, req)
    kv.release(req)
    assert_all_back(kv)


def test_evicted_pages_are_written_back_and_loaded_again_with_their_kv() -> None:
    kv, pool, host = tiered_cache()
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(1, 250, (24,), generator=gen).tolist()  # 6 full pages
    b = torch.randint(1, 250, (28,), generator=gen).tolist()  # 7: evicts most of a's
    run_one(kv, pool, make_request("a", a))
    run_one(kv, pool, make_request("b", b))
    assert host.written_pages >= 5 and host.held == host.written_pages
    again = make_request("a2", [*a, 7, 7, 7])
    kv.admit(again, max_prefix_tokens=len(again.prompt_ids) - 1)
    assert again.cached_len == 24 and again.kv_len == 24  # device pages + pages loaded from the host
    assert host.hit_tokens >= 5 * PAGE and host.loaded_pages >= 5
    for i, h in enumerate(page_hashes(a, PAGE)):
        assert torch.all(pool.buffer[:, :, again.pages[i]] == page_value(h)), f"page {i} of a"
    # The loaded pages are in the tree, locked by the request like any matched page.
    assert kv.usage().locked == 6
    compute(kv, pool, again)
    kv.release(again)
    assert_all_back(kv)


def test_only_pages_not_in_the_host_pool_are_written_back() -> None:
    kv, pool, host = tiered_cache()
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(1, 250, (28,), generator=gen).tolist() for _ in range(2))
    run_one(kv, pool, make_request("a", a))
    run_one(kv, pool, make_request("b", b))  # evicts a's pages: written
    written = host.written_pages
    run_one(kv, pool, make_request("a2", a))  # a's pages back from the host; b's evicted: written
    after_b = host.written_pages
    assert after_b > written
    run_one(kv, pool, make_request("b2", b))  # b's back; a's evicted again: they are on the host already
    run_one(kv, pool, make_request("a3", a))
    assert host.written_pages == after_b


def test_the_host_pool_never_holds_more_than_its_capacity() -> None:
    kv, pool, host = tiered_cache(pages=9, host_pages=5)
    gen = torch.Generator().manual_seed(2)
    convs = [torch.randint(1, 250, (12,), generator=gen).tolist() for _ in range(6)]
    for turn in range(4):
        for i, c in enumerate(convs):
            convs[i] = c = [*c, *torch.randint(1, 250, (4,), generator=gen).tolist()]
            run_one(kv, pool, make_request(f"{i}-{turn}", c[:28]))
            assert host.held <= host.capacity == 5
    assert host.written_pages > 5  # it did turn over
    assert host.buffer.shape[0] == 5


def test_flush_empties_the_host_tier_too() -> None:
    kv, pool, host = tiered_cache()
    gen = torch.Generator().manual_seed(3)
    for i in range(3):
        run_one(kv, pool, make_request(str(i), torch.randint(1, 250, (24,), generator=gen).tolist()))
    assert host.held > 0
    kv.prefix_cache.flush()
    assert host.held == 0 and kv.usage().cached == 0
    assert_all_back(kv)


def slow_loads(host: HostKVPool) -> list[PendingLoad]:
    """Makes the CPU pool's loads pending like CUDA's (the copy is done; the event says no until told)."""
    made: list[PendingLoad] = []
    copy = host.load

    class Event:
        done = False

        def query(self) -> bool:
            return self.done

    def load(slots, pages):
        copy(slots, pages)  # copies, and unpins: pin them again until the "event" completes
        for s in slots:
            host._pins[s] = host._pins.get(s, 0) + 1
        pending = PendingLoad(Event(), list(slots), time.monotonic())  # type: ignore[arg-type]
        host.pending.append(pending)
        made.append(pending)
        return pending

    host.load = load  # type: ignore[method-assign]
    return made


def test_a_request_waits_for_its_load_while_others_run_and_aborts_give_everything_back() -> None:
    kv, pool, host = tiered_cache(pages=13, host_pages=16, slots=3)
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(1, 250, (n,), generator=gen).tolist() for n in (24, 48))
    run_one(kv, pool, make_request("a", a))
    run_one(kv, pool, make_request("b", b))  # a's pages are on the host now
    loads = slow_loads(host)
    sched = Scheduler(SchedulerConfig(3, 64, 256), kv)
    r1, r2 = make_request("r1", [*a, 1]), make_request("r2", [5, 6, 7])
    sched.add(r1)
    sched.add(r2)
    plan = sched.schedule()
    assert loads and r1.cached_len == 24 and r1 in sched.running
    assert [c.request for c in plan.chunks] == [r2]  # r1 waits for its pages; r2 runs
    # Another request matching the pages being loaded waits for that load too.
    r3 = make_request("r3", [*a[:20], 9, 9])
    sched.add(r3)
    plan = sched.schedule()
    assert r3 in sched.running and r3.cached_len == 20
    assert all(c.request is r2 for c in plan.chunks)
    loads[0].event.done = True
    kv.reap_loads()
    assert not host._pins and not kv._loading_nodes
    plan = sched.schedule()
    assert {c.request for c in plan.chunks} >= {r1, r3}
    for r in (r1, r2, r3):
        sched.remove(r)
        kv.release(r)
    assert_all_back(kv)


def test_an_aborted_request_still_loading_gives_its_pages_and_host_pages_back() -> None:
    kv, pool, host = tiered_cache()
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(1, 250, (24,), generator=gen).tolist() for _ in range(2))
    run_one(kv, pool, make_request("a", a))
    run_one(kv, pool, make_request("b", b))
    held = host.held
    loads = slow_loads(host)
    r = make_request("r", [*a, 1])
    kv.admit(r, max_prefix_tokens=len(r.prompt_ids) - 1)
    assert loads and kv.waits_for_load(r)
    kv.release(r, cache_prefix=False)  # aborted with an error before its load landed
    assert kv.usage().locked == 0 and kv.usage().slots_in_use == 0
    assert host._pins  # the copy may still read them
    loads[0].event.done = True
    kv.reap_loads()
    assert_all_back(kv)
    assert host.held >= held  # host entries are kept (a hit does not take them out)
    assert sum(h in host for h in page_hashes(a, PAGE)) == held


# ---- the engine ------------------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)



def counter(engine: Engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model": "tiny"}) or 0.0


def run_engine(host_kv_tokens: int, rounds: list[list[list[int]]], together: bool = False,
               kv_cache_dtype: str = "auto") -> tuple[list[list[int]], dict[str, float]]:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, max_total_tokens=128,
                                 max_running_requests=2, chunked_prefill_size=32, host_kv_tokens=host_kv_tokens,
                                 kv_cache_dtype=kv_cache_dtype))
    engine.start()
    try:
        outs: list[list[int]] = []
        for prompts in rounds:
            if together:
                outs += generate_tokens(engine, prompts, GREEDY, timeout=120)
            else:
                for p in prompts:
                    outs += generate_tokens(engine, [p], GREEDY, timeout=120)
            if engine.host_kv is not None:
                assert engine.host_kv.held <= engine.host_kv.capacity
        deadline = time.monotonic() + 5
        while True:  # the snapshot is taken once per loop turn, after the outputs
            u = engine.state().kv
            if u.free + u.cached == u.capacity and u.locked == 0 and u.slots_in_use == 0:
                break
            assert time.monotonic() < deadline, f"pages not back: {u}"
            time.sleep(0.01)
        names = ("prompt_tokens_computed_total", "host_kv_hit_tokens_total", "host_kv_written_bytes_total",
                 "host_kv_loaded_bytes_total", "host_kv_pages", "host_kv_capacity_pages",
                 "host_kv_load_seconds_count")
        stats = {n: counter(engine, f"splitserve_{n}") for n in names}
        return outs, stats
    finally:
        engine.stop()


@pytest.mark.parametrize("together", [False, True], ids=["one-at-a-time", "batched"])
def test_greedy_output_is_the_same_with_the_host_tier_and_fewer_prompt_tokens_are_computed(together: bool) -> None:
    rounds = multi_turn_prompts(seed=11)  # 6 conversations of 60-75 tokens: ~3x the 128-token device KV
    plain, off = run_engine(0, rounds, together)
    tiered, on = run_engine(1024, rounds, together)
    assert tiered == plain
    assert on["host_kv_hit_tokens_total"] > 0
    assert on["prompt_tokens_computed_total"] < off["prompt_tokens_computed_total"]
    assert on["host_kv_written_bytes_total"] > 0 and on["host_kv_loaded_bytes_total"] > 0
    assert on["host_kv_load_seconds_count"] > 0
    assert 0 < on["host_kv_pages"] <= on["host_kv_capacity_pages"] == 1024 // PAGE
    assert off["host_kv_hit_tokens_total"] == 0


def test_fp8_pages_go_through_the_host_tier_unchanged() -> None:
    """An FP8 KV cache's e4m3 pages are written back and loaded as their bytes: the same greedy output as FP8
    without the tier, and a quarter of float32's bytes per loaded token."""
    rounds = multi_turn_prompts(seed=11)
    plain, _ = run_engine(0, rounds, kv_cache_dtype="fp8_e4m3")
    tiered, on = run_engine(1024, rounds, kv_cache_dtype="fp8_e4m3")
    assert tiered == plain
    assert on["host_kv_hit_tokens_total"] > 0
    layers, kv_heads, head_dim = 4, 2, 32  # the tiny model
    assert on["host_kv_loaded_bytes_total"] == on["host_kv_hit_tokens_total"] * 2 * layers * kv_heads * head_dim


def test_a_host_tier_smaller_than_the_working_set_stays_within_its_bound() -> None:
    rounds = multi_turn_prompts(seed=12)
    plain, _ = run_engine(0, rounds)
    tiered, on = run_engine(64, rounds)  # 16 pages: far less than the working set
    assert tiered == plain
    assert on["host_kv_pages"] <= 16


def test_the_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="host-kv-tokens"):
        EngineConfig(model="tiny", device="cpu", page_size=4, host_kv_tokens=3)
    with pytest.raises(ValueError, match="host-kv-tokens"):
        EngineConfig(model="tiny", device="cpu", page_size=4, host_kv_tokens=64, tp_size=2)
    assert EngineConfig().host_kv_tokens == 0


def test_the_kv_tiers_benchmark_runs_both_sides_on_the_same_trace(tmp_path, capsys) -> None:
    import json

    from splitserve.bench.kv_tiers import main

    out = tmp_path / "kv_tiers.json"
    assert main(["--conversations", "4", "--turns", "3", "--system-len", "96", "--user-len", "16", "--output-len", "4",
                 "--page-size", "4", "--max-total-tokens", "192", "--host-kv-tokens", "1024",
                 "--max-running-requests", "2", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_outputs"] and 2 <= report["working_set_over_device_kv"] <= 4
    assert report["host_tier"]["host_hit_tokens"] > 0 and report["device_only"]["host_hit_tokens"] == 0
    assert report["ratios"]["prompt_tokens_computed"] < 1
    assert "ratios (tier / none)" in capsys.readouterr().out


def test_the_host_tier_reports_its_pages_as_host_events_that_follow_its_evictions() -> None:
    """What a router's index learns: a page the device evicts to host memory moves from the device tier to the
    host tier, a page the host pool gives up leaves it, and a reset reports both tiers."""
    from splitserve.engine.page_events import PageEvents

    events = PageEvents(PAGE)
    pool = KVPool(KVPoolShape(num_layers=2, num_pages=9, page_size=PAGE, num_kv_heads=1, head_dim=2,
                              dtype=torch.float32), torch.device("cpu"))
    host = HostKVPool(pool.buffer, 5, events=events)
    kv = KVCache(9, PAGE, 2, max_context=256, device=torch.device("cpu"), copy_page=pool.copy_page, host=host,
                 page_events=events)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 250, (28,), generator=gen).tolist() for _ in range(4)]
    for i, p in enumerate(prompts):
        run_one(kv, pool, make_request(f"r{i}", p))
    state = events.since(None, 0)
    tiers = {tier: set(hashes) for op, tier, hashes in state["events"]}
    assert state["reset"] and set(tiers) == {"device", "host"}
    assert len(tiers["host"]) == host.held == events.held_in("host") <= 5
    assert tiers["host"] == {h for h in (x for p in prompts for x in page_hashes(p, PAGE)) if h in host}
    assert not tiers["host"] & tiers["device"]  # a page on the host was evicted from the device
    before = state["seq"]
    host.clear()
    gone = events.since(state["epoch"], before)
    assert [(op, tier) for op, tier, _ in gone["events"]] == [("removed", "host")]
    assert set(gone["events"][0][2]) == tiers["host"] and events.held_in("host") == 0
