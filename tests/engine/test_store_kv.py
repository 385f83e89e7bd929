"""The shared store tier (--kv-store) on a real Mooncake Store master on loopback (TCP, P2PHANDSHAKE):
pages one engine evicts are found by another, keys keep models apart, greedy output does not change,
and a master that dies or hangs costs only its hits."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from multi_turn import multi_turn_prompts

pytest.importorskip("mooncake.store")

from splitserve.engine import store_kv
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.offline import generate_tokens
from splitserve.engine.page_events import PageEvents
from splitserve.engine.page_hash import page_hashes
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.store_kv import MISS_TTL_S, StoreKV, start_master, store_namespace
from splitserve.router.prefix_index import PrefixIndex

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def master():
    proc, address = start_master()
    yield proc, address
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def wait_ready(store: StoreKV, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.ready:
        assert time.monotonic() < deadline, "the store client never got set up"
        time.sleep(0.05)


# ---- the KV cache over a store --------------------------------------------------------------------

def store_cache(address: str, namespace: str = "test/ns", pages: int = 9,
                events: PageEvents | None = None) -> tuple[KVCache, KVPool, StoreKV]:
    pool = KVPool(KVPoolShape(num_layers=2, num_pages=pages, page_size=PAGE, num_kv_heads=1, head_dim=2,
                              dtype=torch.float32), torch.device("cpu"))
    store = StoreKV(pool.buffer, address, namespace, segment_bytes=16 << 20, buffer_bytes=1 << 20, timeout_s=2.0,
                    events=events)
    kv = KVCache(pages, PAGE, 2, max_context=256, device=torch.device("cpu"), copy_page=pool.copy_page, store=store,
                 page_events=events)
    wait_ready(store)
    return kv, pool, store


def page_value(page_hash: int) -> float:
    return float(page_hash % 100_003)


def run_one(kv: KVCache, pool: KVPool, prompt: list[int], rid: str) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_new_tokens=4), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=len(prompt) - 1)
    assert kv.grow(req, len(prompt))
    for i, h in enumerate(page_hashes(prompt, PAGE)):
        if i * PAGE >= req.cached_len:
            pool.buffer[:, :, req.pages[i]] = page_value(h)
    req.kv_len = len(prompt)
    kv.release(req)
    u = kv.usage()
    assert u.locked == 0 and u.slots_in_use == 0 and u.free + u.cached == u.capacity
    return req


def wait_idle(store: StoreKV, timeout: float = 40.0) -> None:
    """Until the worker has no call queued or running (a call to a stopped master returns after 30 s)."""
    deadline = time.monotonic() + timeout
    while store.jobs_pending():
        assert time.monotonic() < deadline, "the store worker is still busy"
        time.sleep(0.05)


def wait_written(store: StoreKV, pages: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.written_pages < pages:
        assert time.monotonic() < deadline, f"{store.written_pages} of {pages} pages written"
        time.sleep(0.02)


def test_pages_one_cache_evicts_are_loaded_by_another_with_their_kv_and_other_namespaces_miss(master) -> None:
    _, address = master
    kv1, pool1, store1 = store_cache(address, pages=7)
    kv2, pool2, store2 = store_cache(address)
    kv3, _, store3 = store_cache(address, namespace="other/model")
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(1, 250, (24,), generator=gen).tolist()  # 6 full pages
        b = torch.randint(1, 250, (24,), generator=gen).tolist()  # 6, the whole pool: evicts all of a's
        run_one(kv1, pool1, a, "a")
        run_one(kv1, pool1, b, "b")
        wait_written(store1, 6)
        for i in range(3):  # evicted again and again, each page is written once
            run_one(kv1, pool1, a, f"a{i}")
            run_one(kv1, pool1, b, f"b{i}")
        time.sleep(0.3)
        assert store1.written_pages <= 6 + 6
        # A cache that never saw `a` loads its evicted pages from the store, with their KV.
        req = Request("a2", [*a, 7, 7, 7], SamplingParams(max_new_tokens=4), on_output=lambda _o: None)
        kv2.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
        hits = store2.hit_tokens
        assert hits == 6 * PAGE and req.cached_len == hits and store2.read_pages == hits // PAGE
        for i, h in enumerate(page_hashes(a, PAGE)[:hits // PAGE]):
            assert torch.all(pool2.buffer[:, :, req.pages[i]] == page_value(h)), f"page {i} of a"
        assert kv2.usage().locked == hits // PAGE  # tree pages, locked by the request like any match
        kv2.release(req)
        assert store2.load_seconds
        # Another model's namespace: the same prompt misses.
        run_one(kv3, pool1, [*a, 7], "a3")
        assert store3.hit_tokens == 0
        assert store1.failures == store2.failures == store3.failures == 0
    finally:
        for s in (store1, store2, store3):
            s.close()


def test_a_hung_master_costs_one_timeout_then_lookups_answer_at_once(master) -> None:
    proc, address = master
    kv, pool, store = store_cache(address)
    store.timeout_s = 0.2
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        gen = torch.Generator().manual_seed(1)
        a = torch.randint(1, 250, (24,), generator=gen).tolist()
        started = time.monotonic()
        run_one(kv, pool, a, "a")  # the lookup times out: computed instead
        assert time.monotonic() - started < 1.0
        assert store.failures >= 1 and not store.available()
        started = time.monotonic()
        for i in range(5):  # backing off (and the worker still stuck): no store call, no wait
            run_one(kv, pool, torch.randint(1, 250, (24,), generator=gen).tolist(), f"r{i}")
        assert time.monotonic() - started < 0.5
        assert store.dropped_pages > 0  # write-throughs dropped while it is out of use
        os.kill(proc.pid, signal.SIGCONT)
        wait_idle(store)  # the stuck call returns: the rows it held come back
        assert store.rows_free() == store.capacity
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        store.close()


def store_tier(events: PageEvents) -> set[int]:
    """The "store" pages a reader of every event so far sees."""
    held: set[int] = set()
    for op, tier, hashes in events.since(None, 0)["events"]:
        if tier == "store":
            (held.update if op == "stored" else held.difference_update)(hashes)
    return held


def test_store_pages_are_published_as_the_store_tier_until_the_engine_learns_they_are_gone(master, monkeypatch) -> None:
    proc, address = master
    events1, events2 = PageEvents(PAGE), PageEvents(PAGE)
    kv1, pool1, store1 = store_cache(address, pages=7, events=events1)
    kv2, _, store2 = store_cache(address, events=events2)
    try:
        assert events1.since(None, 0)["store"] == events2.since(None, 0)["store"] == f"{address}/test/ns"
        gen = torch.Generator().manual_seed(3)
        a = torch.randint(1, 250, (24,), generator=gen).tolist()
        b = torch.randint(1, 250, (24,), generator=gen).tolist()
        run_one(kv1, pool1, a, "a")
        assert store_tier(events1) == set()  # nothing put yet: a is on the device
        run_one(kv1, pool1, b, "b")  # evicts a's 6 pages: written through
        wait_written(store1, 6)
        pages_a = page_hashes(a, PAGE)
        deadline = time.monotonic() + 5
        while store_tier(events1) != set(pages_a):  # published once the put returns
            assert time.monotonic() < deadline, store_tier(events1)
            time.sleep(0.02)
        # Another engine that reads them publishes them too; the device tier has what it loaded.
        req = Request("a2", [*a, 7], SamplingParams(max_new_tokens=4), on_output=lambda _o: None)
        kv2.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
        kv2.release(req)
        assert store_tier(events2) == set(pages_a) and events2.held_in("device") == 6
        # A page the master no longer has (evicted; removed here) is reported removed once a lookup sees it gone.
        assert store1._store.remove(store1.key(pages_a[3]), True) == 0
        time.sleep(MISS_TTL_S)  # kv1's own first lookup of a missed: not asked again before this
        req = Request("a3", [*a[:16], 7], SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
        kv1.admit(req, max_prefix_tokens=len(req.prompt_ids) - 1)
        assert req.cached_len == 3 * PAGE
        kv1.release(req)
        tier = store_tier(events1)
        assert tier & set(pages_a) == set(pages_a) - {pages_a[3]}
        # Room for a3 evicted some of b's pages from kv1's device: written through, they may be published already.
        assert tier - set(pages_a) <= set(page_hashes(b, PAGE))
        # The set of keys known to be in the store, and so the published store tier, stays within its bound.
        with monkeypatch.context() as m:
            m.setattr(store_kv, "KNOWN_KEYS", 4)
            run_one(kv1, pool1, a, "a4")  # a's pages in kv1's device again: b's, the last 4 known, are put
            run_one(kv1, pool1, b, "b4")
            wait_idle(store1)
            assert store1.known_keys() == 4 and len(store_tier(events1)) <= 4
        assert store1.rows_free() == store1.capacity
        # A store that fails may come back empty: every page of it is reported removed.
        os.kill(proc.pid, signal.SIGSTOP)
        store1.timeout_s = 0.3
        run_one(kv1, pool1, torch.randint(1, 250, (24,), generator=gen).tolist(), "c")
        assert store1.failures >= 1 and store_tier(events1) == set()
        answer = events1.since(None, 0)
        assert answer["reset"] and all(tier != "store" for _, tier, _ in answer["events"])
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        store1.close()
        store2.close()


# ---- engines --------------------------------------------------------------------------------------


def make_engine(kv_store: str = "", host_kv_tokens: int = 0, kv_cache_dtype: str = "auto") -> Engine:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=PAGE, max_total_tokens=128,
                                 max_running_requests=2, chunked_prefill_size=32, host_kv_tokens=host_kv_tokens,
                                 kv_cache_dtype=kv_cache_dtype,
                                 kv_store=kv_store, kv_store_segment_mb=16, kv_store_buffer_mb=1,
                                 kv_store_timeout_ms=2000))
    if engine.kv_store is not None:
        wait_ready(engine.kv_store)
    engine.start()
    return engine


def metric(engine: Engine, name: str) -> float:
    time.sleep(0.2)  # the loop publishes once a turn (every 50 ms when idle)
    return engine.metrics.registry.get_sample_value(f"splitserve_{name}", {"model": "tiny"}) or 0.0


def run(engine: Engine, rounds: list[list[list[int]]]) -> tuple[list[list[int]], list[int]]:
    """Outputs of every prompt, one at a time, and the cached tokens each reported."""
    outs: list[list[int]] = []
    cached: list[int] = []

    def observe(out: TokenOutput) -> None:
        if out.finish_reason is not None:
            cached.append(out.cached_tokens)

    for prompts in rounds:
        for p in prompts:
            outs += generate_tokens(engine, [p], GREEDY, timeout=120, observe=observe)
    return outs, cached


@pytest.mark.parametrize(("host_kv_tokens", "kv_cache_dtype"), [(0, "auto"), (256, "auto"), (256, "fp8_e4m3")],
                         ids=["no-host-tier", "host-tier", "host-tier-fp8-kv"])
def test_greedy_output_is_the_same_with_the_store_and_a_second_engine_gets_store_hits(master, host_kv_tokens,
                                                                                      kv_cache_dtype) -> None:
    """(FP8 KV: e4m3 pages, under keys of their own dtype, compared with FP8 KV without the store.)"""
    _, address = master
    rounds = multi_turn_prompts(seed=21)  # ~3x the 128-token device KV (and the 256-token host tier)
    plain = make_engine(kv_cache_dtype=kv_cache_dtype)
    try:
        expected, _ = run(plain, rounds)
        computed_plain = metric(plain, "prompt_tokens_computed_total")
    finally:
        plain.stop()
    first = make_engine(address, host_kv_tokens, kv_cache_dtype)
    second = make_engine(address, host_kv_tokens, kv_cache_dtype)
    try:
        outs, _ = run(first, rounds)
        assert outs == expected
        assert metric(first, "kv_store_written_bytes_total") > 0
        deadline = time.monotonic() + 10
        while first.kv_store.jobs_pending():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # The second engine never saw these prompts: the first's evicted pages come from the store.
        outs, cached = run(second, rounds)
        assert outs == expected
        hits = metric(second, "kv_store_hit_tokens_total")
        assert hits > 0 and sum(cached) >= hits
        assert metric(second, "prompt_tokens_computed_total") < computed_plain
        assert metric(second, "kv_store_read_bytes_total") > 0
        assert metric(second, "kv_store_load_seconds_count") > 0
        assert metric(second, "kv_store_failures_total") == 0 and metric(second, "kv_store_up") == 1
        # Both publish their store pages under the same store's name: a router's index reaches them from a new
        # engine on that store that holds nothing itself.
        answers = {"first": first.page_events.since(None, 0), "second": second.page_events.since(None, 0)}
        assert answers["first"]["store"] == answers["second"]["store"]
        assert answers["first"]["store"].startswith(f"{address}/splitserve/")
        assert any(tier == "store" and hashes for _, tier, hashes in answers["first"]["events"])
        answers["new"] = {**answers["first"], "epoch": "new", "events": []}
        index = PrefixIndex()
        for url, answer in answers.items():
            index.apply_events(url, answer)
        prompt = page_hashes(rounds[0][0], PAGE)
        depth = index.match(prompt, list(answers))
        assert depth["new"] == 0 and index.store_match(prompt, depth)["new"] >= 1
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_master_killed_or_hung_mid_load_fails_no_request_and_changes_no_output(master, sig) -> None:
    proc, address = master
    rounds = multi_turn_prompts(seed=22, conversations=8)
    plain = make_engine()
    try:
        expected, _ = run(plain, rounds)
    finally:
        plain.stop()
    engine = make_engine(address, host_kv_tokens=256)
    try:
        engine.kv_store.timeout_s = 0.3
        killer = threading.Timer(1.0, lambda: os.kill(proc.pid, sig))
        killer.start()
        prompts = [p for r in rounds for p in r]
        outs = generate_tokens(engine, prompts[:len(prompts) // 2], GREEDY, timeout=120, stagger_s=0.1)
        killer.join()
        outs += generate_tokens(engine, prompts[len(prompts) // 2:], GREEDY, timeout=120)
        if sig == signal.SIGKILL:
            assert proc.wait(timeout=5) == -signal.SIGKILL
        else:
            assert proc.poll() is None  # still there, answering nothing
        assert outs == expected
        assert metric(engine, "kv_store_failures_total") >= 1
        assert metric(engine, "kv_store_up") == 0
        if sig == signal.SIGSTOP:
            os.kill(proc.pid, signal.SIGCONT)  # the hung call returns (a killed master's calls fail by themselves)
        wait_idle(engine.kv_store)
        assert engine.kv_store.rows_free() == engine.kv_store.capacity  # no staging row lost to the failures
        usage = engine.kv.usage()
        assert usage.locked == 0 and usage.slots_in_use == 0 and usage.free + usage.cached == usage.capacity
    finally:
        engine.stop()


def test_keys_keep_models_page_sizes_and_dtypes_apart(tmp_path) -> None:
    a = tmp_path / "a"
    b = tmp_path / "b"
    for folder, layers in ((a, 2), (b, 3)):
        folder.mkdir()
        (folder / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
    shape = (2, 2, 16, 1, 8)
    base = store_namespace("m", a, None, 16, torch.bfloat16, shape)
    assert base == store_namespace("m", a, None, 16, torch.bfloat16, shape)
    others = {store_namespace("m", b, None, 16, torch.bfloat16, shape),
              store_namespace("m", a, None, 32, torch.bfloat16, (2, 2, 32, 1, 8)),
              store_namespace("m", a, None, 16, torch.float16, shape),
              store_namespace("m", a, 1, 16, torch.bfloat16, shape),
              store_namespace("other", a, None, 16, torch.bfloat16, shape),
              store_namespace("m", a, None, 16, torch.bfloat16, shape, "kv-scales:0123abcd")}
    assert base not in others and len(others) == 6


def test_the_flags_are_checked() -> None:
    assert EngineConfig().kv_store == ""
    with pytest.raises(ValueError, match="kv-store"):
        EngineConfig(model="tiny", device="cpu", kv_store="127.0.0.1:1", tp_size=2)
    with pytest.raises(ValueError, match="kv-store"):
        EngineConfig(model="tiny", device="cpu", kv_store="127.0.0.1:1", kv_store_buffer_mb=0)


def test_the_kv_tiers_benchmark_has_a_store_leg(tmp_path, capsys) -> None:
    import json

    from splitserve.bench.kv_tiers import main

    out = tmp_path / "kv_tiers.json"
    assert main(["--conversations", "4", "--turns", "3", "--system-len", "96", "--user-len", "16", "--output-len", "4",
                 "--page-size", "4", "--max-total-tokens", "192", "--host-kv-tokens", "1024",
                 "--max-running-requests", "2", "--kv-store", "local", "--kv-store-segment-mb", "32",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_outputs"]
    first, second = report["store_first"], report["store_second"]
    assert first["store_written_bytes"] > 0 and first["store_failures"] == second["store_failures"] == 0
    assert second["store_hit_tokens"] > 0 and 0 < report["store_hit_rate"] < 1
    assert 0 < report["store_share_of_misses"] <= 1
    assert report["store_ratios"]["prompt_tokens_computed"] < 1
    printed = capsys.readouterr().out
    assert "store hit rate of the second instance" in printed and "ratios (second instance" in printed
