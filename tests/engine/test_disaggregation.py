"""Prefill/decode over Mooncake TCP on loopback, behind the router: identical to the unified engine.

Real processes: a unified engine (the reference), prefill and decode engines and the router.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start, bootstrap_grant, engine_state, free_port

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cpu"]
# Fast failure detection for the tests; the defaults are for production.
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "5"]

pytestmark = pytest.mark.slow


def new_deployment(tmp: Path, checkpoint: Path) -> LocalDeployment:
    return LocalDeployment(tmp, checkpoint, ENGINE_ARGS, TRANSFER_ARGS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory):
    """A unified reference and a 2P2D deployment (1P1D is a router over one of each)."""
    d = new_deployment(tmp_path_factory.mktemp("pd"), checkpoint)
    try:
        unified = d.engine("unified")
        prefill = [d.engine("prefill"), d.engine("prefill")]
        decode = [d.engine("decode"), d.engine("decode")]
        d.wait([unified, *prefill, *decode])
        r11 = d.router(prefill[:1], decode[:1])
        r22 = d.router(prefill, decode)
        d.wait([r11, r22], timeout=60)
        yield {"deployment": d, "unified": unified, "prefill": prefill, "decode": decode, "1p1d": r11, "2p2d": r22}
    finally:
        d.stop()


@pytest.fixture(autouse=True)
def pages_back_everywhere(cluster):
    yield
    for url in [cluster["unified"], *cluster["prefill"], *cluster["decode"]]:
        if cluster["deployment"].alive(url):
            assert_kv_back_to_start(url)


def prompts_of_mixed_lengths(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (18,), generator=gen).tolist()
    out = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 6, 15)]
    out += [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 8, 33, 70)]
    return out


async def generate_all(url: str, prompts: list[list[int]], max_tokens: int, stream: bool = False) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(p: list[int]) -> list[int]:
            body = {"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            if not stream:
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            tokens: list[int] = []
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        import json
                        tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
            return tokens
        return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.parametrize("shape", ["1p1d", "2p2d"])
def test_greedy_output_equals_unified_for_concurrent_mixed_lengths(cluster, shape: str) -> None:
    prompts = prompts_of_mixed_lengths(3)
    want = asyncio.run(generate_all(cluster["unified"], prompts, 20))
    got = asyncio.run(generate_all(cluster[shape], prompts, 20))
    assert got == want


def test_streamed_through_the_router_equals_unified(cluster) -> None:
    prompts = prompts_of_mixed_lengths(4)[:4]
    want = asyncio.run(generate_all(cluster["unified"], prompts, 12))
    assert asyncio.run(generate_all(cluster["1p1d"], prompts, 12, stream=True)) == want


def test_decode_side_prefix_reuse_sends_only_the_rest_and_matches(cluster) -> None:
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (24,), generator=gen).tolist()
    first = [*prefix, 1, 2, 3]
    second = [*prefix, 9, 8, 7, 6, 5]
    want = asyncio.run(generate_all(cluster["unified"], [first, second], 10))
    assert asyncio.run(generate_all(cluster["1p1d"], [first], 10)) == want[:1]
    decode, prefill = cluster["decode"][0], cluster["prefill"][0]

    def sent_bytes() -> float:
        return _metric(httpx.get(f"{prefill}/metrics", timeout=5).text, "splitserve_transfer_bytes_total")

    hits_before, bytes_before = engine_state(decode)["prefix_hit_tokens"], sent_bytes()
    assert asyncio.run(generate_all(cluster["1p1d"], [second], 10)) == want[1:]
    # Decode held the 24-token prefix (6 pages of 4) from the first request ...
    assert engine_state(decode)["prefix_hit_tokens"] - hits_before == 24
    # ... so only the last 5 tokens' KV travelled: 2 pages of the 8 the prompt spans (+ the aux).
    layers, kv_heads, head_dim, page = 3, 2, 16, 4
    page_bytes = 2 * layers * page * kv_heads * head_dim * 4  # k and v, float32
    assert sent_bytes() - bytes_before < 3 * page_bytes


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_direct_request_to_prefill_or_decode_without_room_is_refused(cluster) -> None:
    for url in (cluster["prefill"][0], cluster["decode"][0]):
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
        assert "bootstrap" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_router_fans_out_n_and_prompt_lists_like_the_unified_engine(cluster, stream: bool) -> None:
    """n > 1 and a list of prompts through 2P2D: choices in the unified engine's order, its greedy
    tokens, its usage (a prompt's cached tokens: the fewest its samples found, however they
    arrived); seeded samples of one prompt differ (seed + j). Prompts new to every engine per
    case, so that the cache holds none of them from the other case."""
    prompts = [[t + 20 * stream for t in p] for p in ([5, 6, 7, 8], [9, 10], [11, 12, 13])]
    body = {"model": "m", "prompt": prompts, "n": 2, "max_tokens": 6, "return_token_ids": True, "ignore_eos": True,
            "temperature": 0}
    greedy = body

    def answer(url: str, **extra) -> tuple[dict[int, list[int]], dict]:
        body = {**greedy, **extra}
        if not stream:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return {c["index"]: c["token_ids"] for c in r.json()["choices"]}, r.json()["usage"]
        tokens: dict[int, list[int]] = {}
        usage = None
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
        for event in map(json.loads, lines[:-1]):
            for c in event["choices"]:
                tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            usage = event.get("usage") or usage
        return tokens, usage

    unified, split = answer(cluster["unified"]), answer(cluster["2p2d"])
    assert sorted(split[0]) == list(range(6))
    assert split == unified
    seeded = answer(cluster["2p2d"], temperature=1.0, seed=11)[0]
    assert seeded[0] != seeded[1]  # seed + j: the two samples of a prompt differ
    assert split[1]["prompt_tokens"] == sum(len(p) for p in prompts) and split[1]["completion_tokens"] == 36


def prompt_tokens_computed(urls: list[str]) -> float:
    return sum(_metric(httpx.get(f"{u}/metrics", timeout=5).text, "splitserve_prompt_tokens_computed_total")
               for u in urls)


@pytest.mark.parametrize("prompt_len", [18, 16])
@pytest.mark.parametrize("shape", ["unified", "1p1d", "2p2d"])
def test_the_n_samples_of_a_request_compute_its_prompt_once(cluster, shape: str, prompt_len: int) -> None:
    """n = 4 on an 18-token prompt (pages of 4): the first sample computes the prompt, the others
    wait for its 4 full pages in the prefix cache and a copy of its partial last page, and compute
    only the last token (the router sends all four to one prefill): 18 + 3 * 1 prompt tokens
    instead of 72 (18 + 3 * 2 when the last page was computed again); on a 16-token prompt the
    last page is a cached full page, copied: 16 + 3 * 1 (16 + 3 * 4 before). Decodes compute none.
    Greedy samples equal n = 1; seeded sample j equals n = 1 with seed + j, as before."""
    seed = ["unified", "1p1d", "2p2d"].index(shape) + 40 + prompt_len  # a prompt no other test (or shape) cached
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    computing = [cluster["unified"]] if shape == "unified" else cluster["prefill"]
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}

    def tokens(**extra) -> list[list[int]]:
        r = httpx.post(f"{cluster[shape]}/v1/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in r.json()["choices"]]

    before, decode_before = prompt_tokens_computed(computing), prompt_tokens_computed(cluster["decode"])
    greedy = tokens(n=4, temperature=0)
    assert prompt_tokens_computed(computing) - before == prompt_len + 3 * 1
    assert prompt_tokens_computed(cluster["decode"]) == decode_before
    assert greedy == [tokens(temperature=0)[0]] * 4
    seeded = tokens(n=4, temperature=1.0, seed=21)
    assert seeded == [tokens(temperature=1.0, seed=21 + j)[0] for j in range(4)]
    assert len({tuple(t) for t in seeded}) > 1


def test_one_request_at_a_time_reaches_both_decodes_and_both_prefills(cluster) -> None:
    """Ties in load go round robin: four sequential requests through 2P2D land two on each decode
    (and each prefill); the router's load counters are back at zero after each."""
    def generated(url: str) -> float:
        return _metric(httpx.get(f"{url}/metrics", timeout=5).text, "splitserve_generation_tokens_total")

    before = {u: generated(u) for u in cluster["decode"]}
    computed = {u: prompt_tokens_computed([u]) for u in cluster["prefill"]}
    for i in range(4):
        body = {"model": "m", "prompt": [60 + i, 61, 62], "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        assert httpx.post(f"{cluster['2p2d']}/v1/completions", json=body, timeout=60).status_code == 200
        in_flight = [b["in_flight"] for b in httpx.get(f"{cluster['2p2d']}/health", timeout=5).json()["backends"]]
        assert in_flight == [0, 0, 0, 0]
    assert {u: generated(u) - before[u] for u in cluster["decode"]} == {u: 2 * 3 for u in cluster["decode"]}
    assert all(prompt_tokens_computed([u]) - computed[u] == 2 * 3 for u in cluster["prefill"])


@pytest.mark.parametrize("shape", ["1p1d", "2p2d"])
def test_seeded_sampling_through_prefill_and_decode_equals_unified(cluster, shape: str) -> None:
    """temperature > 0 with a seed: the decode draws each token from (seed, position), so the
    tokens after the prefill's first one equal the unified engine's too (also with top-p)."""
    prompts = prompts_of_mixed_lengths(8)[:4]

    def sampled(url: str, **extra) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            body = {"model": "m", "prompt": p, "max_tokens": 10, "ignore_eos": True, "return_token_ids": True,
                    "temperature": 1.0, "seed": 100 + i, **extra}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["token_ids"])
        return out

    for extra in ({}, {"top_p": 0.9, "temperature": 0.8}):
        want = sampled(cluster["unified"], **extra)
        assert sampled(cluster[shape], **extra) == want
        assert len({t for tokens in want for t in tokens}) > 10  # sampled, not greedy


def test_unreachable_bootstrap_fails_the_decode_request_and_frees_its_pages(cluster) -> None:
    """A decode told to meet a prefill that is not there fails within the bootstrap timeout."""
    body = {"model": "m", "prompt": list(range(30)), "max_tokens": 4,
            **bootstrap_grant("127.0.0.1", free_port(), 12345)}
    started = time.monotonic()
    r = httpx.post(f"{cluster['decode'][1]}/v1/completions", json=body, timeout=120)
    assert r.status_code == 503
    assert "KV transfer from prefill failed" in r.json()["error"]["message"]
    assert time.monotonic() - started < 15


GLOG_ERROR_LINE = re.compile(r"^E\d{4} \d\d:\d\d:\d\d")  # glog's format: E1204 20:28:20.105218 ...


def test_a_healthy_pair_prints_no_error_lines(checkpoint: Path, tmp_path: Path) -> None:
    """Mooncake logs through glog to stderr: starting its engines printed `E... Local segment descriptor not
    found` and `No RDMA devices found` on every healthy start. A pair that starts, serves through the router
    (each peer's writer engine is made on its first write) and stops prints no error line at all."""
    d = new_deployment(tmp_path, checkpoint)
    try:
        prefill, decode = d.engine("prefill"), d.engine("decode")
        d.wait([prefill, decode])
        router = d.router([prefill], [decode])
        d.wait([router], timeout=60)
        for prompt in ([1, 2, 3], list(range(40))):
            r = httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4},
                           timeout=60)
            assert r.status_code == 200, r.text
    finally:
        d.stop()
    for url in (prefill, decode):
        log = d.procs[url].log.read_text()
        assert "transfer manager" in log  # the engine's Mooncake side did start
        bad = [line for line in log.splitlines() if GLOG_ERROR_LINE.match(line) or " ERROR " in line
               or "No RDMA devices found" in line]
        assert not bad, f"{url} logged error lines on a healthy run:\n" + "\n".join(bad)


def test_prefill_killed_mid_request_is_retried_on_another_or_fails_fast(checkpoint: Path, tmp_path: Path) -> None:
    d = new_deployment(tmp_path, checkpoint)
    try:
        # Chunks of 8: a 900-token prompt takes 113 steps, so the kill lands mid-prefill.
        doomed, spare = d.engine("prefill", "--chunked-prefill-size", "8"), d.engine("prefill")
        decode = d.engine("decode")
        d.wait([doomed, spare, decode])
        router = d.router([doomed, spare], [decode])
        d.wait([router], timeout=60)
        prompt = torch.randint(0, 256, (900,), generator=torch.Generator().manual_seed(9)).tolist()
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                calls = [asyncio.ensure_future(client.post(f"{router}/v1/completions", json=body)) for _ in range(4)]
                deadline = time.monotonic() + 30
                while engine_state(doomed)["running"] == 0:  # the router spreads the four over both prefills
                    assert time.monotonic() < deadline, "no request reached the doomed prefill"
                    await asyncio.sleep(0.005)
                d.procs[doomed].kill()
                return list(await asyncio.gather(*calls))

        started = time.monotonic()
        responses = asyncio.run(run())
        elapsed = time.monotonic() - started
        assert elapsed < 30, f"requests hung for {elapsed:.0f} s after the prefill died"
        for r in responses:
            # Retried on the spare prefill, or (if the decode side failed first) a clear error.
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["message"]
        assert any(r.status_code == 200 for r in responses)
        ok = [r.json()["choices"][0]["token_ids"] for r in responses if r.status_code == 200]
        assert all(t == ok[0] for t in ok)
        retries = _metric(httpx.get(f"{router}/metrics").text, "splitserve_router_retries_total")
        assert retries >= 1
        assert_kv_back_to_start(decode, timeout=20)
        assert_kv_back_to_start(spare)
    finally:
        d.stop()


@pytest.mark.parametrize("prefill_order", ["computes-ahead", "waits-for-decode"])
def test_request_dropped_while_waiting_for_decode_pages_releases_the_prefill_at_once(checkpoint: Path,
                                                                                     tmp_path: Path,
                                                                                     prefill_order: str) -> None:
    """Decode has one slot, held by a request whose KV never comes (no prefill has its room: decode
    waits out its 60 s bootstrap timeout); a second request waits for the slot and its client gives
    up. Decode tells the prefill (abort_room), so the prefill's pages come back at once rather than
    after its 60 s timeouts. (No router here: it would cancel the prefill request itself and hide
    what decode does.) The holder used to be a request decoding 900 tokens: on a loaded 2-core CI
    machine it finished 1.6 s after it started, 0.25 s after the client's timeout here (and, at times,
    before it); a holder waiting for KV holds the slot whatever the speed. By default the prefill computes the
    prompt meanwhile and holds its KV with --no-prefill-waits-for-decode; by default it computes nothing."""
    import threading

    d = new_deployment(tmp_path, checkpoint)
    slow = ["--transfer-bootstrap-timeout-s", "60", "--transfer-waiting-timeout-s", "60"]
    waits = prefill_order == "waits-for-decode"
    try:
        prefill = d.engine("prefill", *slow, *([] if waits else ["--no-prefill-waits-for-decode"]))
        decode = d.engine("decode", "--max-running-requests", "1", *slow)
        d.wait([prefill, decode])
        info = httpx.get(f"{prefill}/health", timeout=5).json()
        host, port = info["bootstrap_host"], info["bootstrap_port"]

        def post_in_background(url: str, room: int, prompt: list[int], max_tokens: int = 4) -> None:
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    **bootstrap_grant(host, port, room)}
            threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120),
                             daemon=True).start()

        # A request whose prefill never comes holds decode's only slot.
        post_in_background(decode, 777, list(range(30)))
        deadline = time.monotonic() + 20
        while engine_state(decode)["slots_in_use"] < 1:
            assert time.monotonic() < deadline, "the slot holder never took the slot"
            time.sleep(0.02)
        steps_before = engine_state(prefill)["steps"]
        post_in_background(prefill, 4242, list(range(50, 90)))
        # Waiting, it holds the request until decode has pages; computing ahead, it runs the prompt now.
        while (engine_state(prefill)["waiting"] < 1) if waits else (engine_state(prefill)["steps"] == steps_before):
            assert time.monotonic() < deadline, "the prefill never took the request"
            time.sleep(0.02)
        with pytest.raises(httpx.ReadTimeout):  # decode keeps it pending (no slot); the client gives up
            httpx.post(f"{decode}/v1/completions", timeout=1.0, json={
                "model": "m", "prompt": list(range(50, 90)), "max_tokens": 4, **bootstrap_grant(host, port, 4242)})
        assert engine_state(decode)["slots_in_use"] == 1, "the holder ended too soon"
        assert_kv_back_to_start(prefill, timeout=1.5)  # not the 60 s timeout: decode told it
        if waits:  # SGLang's order: a prefill computes nothing before its decode has pages (and sent metadata)
            assert engine_state(prefill)["steps"] == steps_before, "prefill ran a prompt no decode had pages for"
    finally:
        d.stop()


def test_client_gone_from_a_non_streamed_router_request_aborts_it_on_the_engines(cluster) -> None:
    decode = cluster["decode"][0]

    def aborted() -> float:
        text = httpx.get(f"{decode}/metrics", timeout=5).text
        rows = [ln for ln in text.splitlines()
                if ln.startswith("splitserve_requests_finished_total") and 'reason="abort"' in ln]
        return float(rows[0].rsplit(" ", 1)[1]) if rows else 0.0

    before = aborted()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster['1p1d']}/v1/completions", timeout=0.5, json={
            "model": "m", "prompt": list(range(100)), "max_tokens": 900, "temperature": 0, "ignore_eos": True})
    assert_kv_back_to_start(cluster["prefill"][0], timeout=10)
    assert_kv_back_to_start(decode, timeout=10)
    assert aborted() == before + 1, "decode finished the request instead of aborting it"


def fences_lifted(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(rf'^splitserve_transfer_fences_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_pages_of_a_transfer_aborted_mid_way_come_back_once_the_prefill_confirms(cluster) -> None:
    """After metadata went out, the prefill may still write into those pages: decode fences them
    until the prefill confirms no write for the room is in flight (transfer/write_fence.py). A live
    prefill answers in a round trip, so they come back at once, not after a timeout
    (tests/engine/test_transfer_fence.py freezes the prefill instead)."""
    decode, prefill = cluster["decode"][1], cluster["prefill"][1]
    acknowledged = fences_lifted(decode, "acknowledged")
    info = httpx.get(f"{prefill}/health", timeout=5).json()
    body = {"model": "m", "prompt": list(range(60)), "max_tokens": 4,
            **bootstrap_grant(info["bootstrap_host"], info["bootstrap_port"], 99991)}
    with pytest.raises(httpx.ReadTimeout):  # no prefill request for this room: decode waits for KV
        httpx.post(f"{decode}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 5
    while engine_state(decode)["requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ended = time.monotonic()
    assert_kv_back_to_start(decode, timeout=5)
    assert time.monotonic() - ended < 1.0
    assert fences_lifted(decode, "acknowledged") == acknowledged + 1


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_requests_that_end_at_their_first_tokens_match_unified(cluster, max_tokens: int) -> None:
    """The first token is sampled on prefill and travels in the aux data: a request that ends with
    it (or right after) still completes on decode, with pages back on both sides."""
    prompts = prompts_of_mixed_lengths(11)[:4]
    want = asyncio.run(generate_all(cluster["unified"], prompts, max_tokens))
    got = asyncio.run(generate_all(cluster["1p1d"], prompts, max_tokens))
    assert got == want and all(len(t) == max_tokens for t in got)
