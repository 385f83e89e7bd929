"""The router routes around failure: real engines killed with SIGKILL under it.

Engines' bootstrap timeout is 60 s here, so an answer within a few seconds after a kill shows
the router noticed the failure itself rather than waiting for the transfer layer to time out.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start, engine_state

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "60"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))
    d = LocalDeployment(tmp_path_factory.mktemp("failover"), checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        prefill = [d.engine("prefill"), d.engine("prefill")]
        decode = [d.engine("decode"), d.engine("decode")]
        d.wait([*prefill, *decode])
        router = d.router(prefill, decode, "--eject-backoff-s", "0.2", "--eject-backoff-max-s", "1")
        d.wait([router], timeout=60)
        yield {"d": d, "prefill": prefill, "decode": decode, "router": router}
    finally:
        d.stop()


def body(max_tokens: int = 8, **extra) -> dict:
    return {"model": "m", "prompt": list(range(1, 40)), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def backends(router: str) -> dict[str, dict]:
    return {b["url"]: b for b in httpx.get(f"{router}/health", timeout=5).json()["backends"]}


def assert_router_counts_back_to_zero(router: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{router}/health", timeout=5).json()
        if health["in_flight"] == 0 and all(b["in_flight"] == 0 for b in health["backends"]):
            return
        assert time.monotonic() < deadline, f"router load counters not back to zero: {health}"
        time.sleep(0.05)


def wait_until_healthy_again(cluster, url: str, timeout: float = 120.0) -> None:
    cluster["d"].restart(url)
    cluster["d"].wait([url], timeout=timeout)
    deadline = time.monotonic() + 15
    while not backends(cluster["router"])[url]["healthy"]:  # probed back in
        assert time.monotonic() < deadline, backends(cluster["router"])[url]
        time.sleep(0.1)


def decoding_on(urls: list[str]) -> str:
    deadline = time.monotonic() + 20
    while True:
        for url in urls:
            if engine_state(url)["running"]:
                return url
        assert time.monotonic() < deadline, "no decode started the request"
        time.sleep(0.01)


def test_dead_decode_is_noticed_at_once_and_requests_go_to_the_other(cluster) -> None:
    router, (dead, alive) = cluster["router"], cluster["decode"]
    want = httpx.post(f"{router}/v1/completions", json=body(), timeout=60).json()["choices"][0]["token_ids"]
    cluster["d"].procs[dead].kill()
    for stream in (False, False, True, False, True, False):
        started = time.monotonic()
        if stream:
            with httpx.stream("POST", f"{router}/v1/completions", json=body(stream=True), timeout=60) as r:
                assert r.status_code == 200
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            assert not any("error" in e for e in events), events
            got = [t for e in events for t in e["choices"][0].get("token_ids", [])]
        else:
            r = httpx.post(f"{router}/v1/completions", json=body(), timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["token_ids"]
        assert got == want
        assert time.monotonic() - started < 10, "waited for a transfer timeout instead of noticing the dead decode"
    state = backends(router)
    assert not state[dead]["healthy"] and state[dead]["ejections"] == 1 and state[alive]["healthy"]
    assert httpx.get(f"{router}/ready", timeout=5).status_code == 200  # a prefill and a decode are left
    assert_router_counts_back_to_zero(router)
    for url in [*cluster["prefill"], alive]:
        assert_kv_back_to_start(url)

    # Readiness follows the backends, liveness does not: a router whose only decode is the dead one. A request
    # waits --backend-wait-s for a healthy decode, then gets a 503 that says so.
    lonely = cluster["d"].router(cluster["prefill"], [dead], "--backend-wait-s", "0.5")
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{lonely}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ready = httpx.get(f"{lonely}/ready", timeout=5)
    assert ready.status_code == 503 and "0 healthy decode" in ready.json()["summary"]
    started = time.monotonic()
    r = httpx.post(f"{lonely}/v1/completions", json=body(), timeout=30)
    assert 0.5 <= time.monotonic() - started < 5
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_backend" and "waited 0.5 s for one" in r.text, r.text
    cluster["d"].procs[lonely].stop()

    wait_until_healthy_again(cluster, dead)
    r = httpx.post(f"{router}/v1/completions", json=body(), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want


def test_requests_wait_for_a_restarted_only_decode_and_none_is_lost(cluster) -> None:
    """One prefill and one decode behind a router; the decode is killed with requests in flight (none has its first
    token yet) and more arriving, then started again at its address. Every request is answered, token for token
    as before, by the restarted decode: those in flight are retried on it once its probe passes, the new ones wait
    for it (--backend-wait-s); none gets a 503, and every count is back at zero."""
    d = cluster["d"]
    victim = cluster["decode"][0]
    pair = d.router(cluster["prefill"][:1], [victim], "--eject-backoff-s", "0.2", "--eject-backoff-max-s", "1")
    d.wait([pair], timeout=60)
    try:
        want = httpx.post(f"{pair}/v1/completions", json=body(300), timeout=120).json()["choices"][0]["token_ids"]

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                sent = [asyncio.ensure_future(client.post(f"{pair}/v1/completions", json=body(300)))
                        for _ in range(4)]
                await until(lambda: in_flight(client, pair), 4)
                decoding_on([victim])
                d.procs[victim].kill()
                sent += [asyncio.ensure_future(client.post(f"{pair}/v1/completions", json=body(300)))
                         for _ in range(4)]
                await asyncio.sleep(0.5)
                d.restart(victim)
                return list(await asyncio.gather(*sent))
        answers = asyncio.run(run())
        assert [r.status_code for r in answers] == [200] * 8, [r.text[:200] for r in answers]
        assert all(r.json()["choices"][0]["token_ids"] == want for r in answers)
        assert backends(pair)[victim]["ejections"] == 1
        assert_router_counts_back_to_zero(pair)
        for url in (cluster["prefill"][0], victim):
            assert_kv_back_to_start(url, timeout=20)
    finally:
        d.procs[pair].stop()
    deadline = time.monotonic() + 15
    while not backends(cluster["router"])[victim]["healthy"]:  # the shared router took it back too
        assert time.monotonic() < deadline, backends(cluster["router"])[victim]
        time.sleep(0.1)


def test_decode_killed_mid_answer_retries_a_whole_answer_and_breaks_a_started_stream(cluster) -> None:
    router = cluster["router"]
    want = httpx.post(f"{router}/v1/completions", json=body(300), timeout=120).json()["choices"][0]["token_ids"]

    # Not streamed: nothing reached the client yet, so it is retried on the other pair.
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(r=httpx.post(f"{router}/v1/completions", json=body(300),
                                                                      timeout=120)))
    call.start()
    victim = decoding_on(cluster["decode"])
    time.sleep(0.3)
    cluster["d"].procs[victim].kill()
    call.join(timeout=60)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["token_ids"] == want
    wait_until_healthy_again(cluster, victim)

    # Streamed, with tokens already at the client: the stream ends with an OpenAI-style error event.
    with httpx.stream("POST", f"{router}/v1/completions", json=body(300, stream=True), timeout=60) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
        victim = decoding_on(cluster["decode"])
        cluster["d"].procs[victim].kill()
        rest = [ln for ln in lines if ln]
    errors = [json.loads(ln[6:]) for ln in rest if ln.startswith("data: {") and '"error"' in ln]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error", rest[-3:]
    assert errors[0]["error"]["code"] == "upstream_failed" and rest[-1] == "data: [DONE]"
    assert_router_counts_back_to_zero(router)
    survivor = next(u for u in cluster["decode"] if u != victim)
    for url in [*cluster["prefill"], survivor]:
        assert_kv_back_to_start(url, timeout=20)
    wait_until_healthy_again(cluster, victim)


def test_load_counters_stay_exact_when_clients_leave(cluster) -> None:
    router = cluster["router"]
    with httpx.stream("POST", f"{router}/v1/completions", json=body(400, stream=True), timeout=60) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: {"))
        assert httpx.get(f"{router}/health", timeout=5).json()["in_flight"] == 1
    # ... left mid-stream; and one that leaves before its (non-streamed) answer:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router}/v1/completions", json=body(900), timeout=0.5)

    async def many_leave() -> None:
        async with httpx.AsyncClient(timeout=0.5) as client:
            calls = [client.post(f"{router}/v1/completions", json=body(900 - i)) for i in range(6)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(x, httpx.ReadTimeout) for x in results), results
    asyncio.run(many_leave())
    assert_router_counts_back_to_zero(router)
    for url in [*cluster["prefill"], *cluster["decode"]]:
        assert_kv_back_to_start(url, timeout=20)


def test_past_the_in_flight_limits_the_router_answers_503_with_retry_after_at_once(cluster) -> None:
    """Past --max-in-flight, and past every backend's limit with no wait allowed (--queue-timeout-s 0): a 503 with
    Retry-After at once; the requests that hold the slots finish."""
    d = cluster["d"]
    overall = d.router(cluster["prefill"], cluster["decode"], "--max-in-flight", "1")
    per_backend = d.router(cluster["prefill"], cluster["decode"], "--max-in-flight-per-backend", "1",
                           "--queue-timeout-s", "0")
    d.wait([overall, per_backend], timeout=60)
    try:
        for router, holders in ((overall, 1), (per_backend, 2)):
            async def run(router: str = router, holders: int = holders) -> None:
                async with httpx.AsyncClient(timeout=120) as client:
                    held = [asyncio.ensure_future(client.post(f"{router}/v1/completions", json=body(300)))
                            for _ in range(holders)]
                    while httpx.get(f"{router}/health", timeout=5).json()["in_flight"] < holders:
                        await asyncio.sleep(0.02)
                    started = time.monotonic()
                    r = await client.post(f"{router}/v1/completions", json=body())
                    assert time.monotonic() - started < 2
                    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                    assert r.json()["error"]["code"] == "overloaded"
                    assert all(x.status_code == 200 for x in await asyncio.gather(*held))
            asyncio.run(run())
            assert_router_counts_back_to_zero(router)
    finally:
        d.procs[overall].stop()
        d.procs[per_backend].stop()


def test_requests_past_every_backend_s_limit_wait_in_line_and_are_served_in_arrival_order(cluster) -> None:
    """One pair with one slot each, held by a request the test ends itself (its client leaves): the next requests
    wait in the router's line instead of failing, are served once the slot frees up, first come first served, and
    the line's gauge shows them while they wait. With a short --queue-timeout-s, one that waits too long gets the
    503 and leaves the line."""
    d = cluster["d"]
    pair = (cluster["prefill"][:1], cluster["decode"][:1])
    queued = d.router(*pair, "--max-in-flight-per-backend", "1")
    short = d.router(*pair, "--max-in-flight-per-backend", "1", "--queue-timeout-s", "0.5")
    d.wait([queued, short], timeout=60)

    async def hold(client: httpx.AsyncClient, router: str) -> asyncio.Future:
        """A long request on the router's only slot; cancelling it is its client leaving."""
        holder = asyncio.ensure_future(client.post(f"{router}/v1/completions", json=body(900)))
        await until(lambda: in_flight(client, router), 1)
        return holder

    try:
        async def run() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                holder = await hold(client, queued)
                finished: list[int] = []

                async def waiter(i: int) -> httpx.Response:
                    r = await client.post(f"{queued}/v1/completions", json=body(8))
                    finished.append(i)
                    return r
                waiting = []
                for i in range(4):  # one after another, so their arrival order is known
                    waiting.append(asyncio.ensure_future(waiter(i)))
                    await until(lambda: line_length(client, queued), i + 1)
                assert not holder.done() and not any(w.done() for w in waiting)
                holder.cancel()
                answers = await asyncio.gather(*waiting)
                assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
                assert finished == [0, 1, 2, 3]  # one slot: each ran after the one ahead of it
                assert await line_length(client, queued) == 0

                holder = await hold(client, short)
                started = time.monotonic()
                r = await client.post(f"{short}/v1/completions", json=body())
                assert 0.5 <= time.monotonic() - started < 5
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert "waited 0.5 s for a slot" in r.json()["error"]["message"]
                assert await line_length(client, short) == 0 and not holder.done()
                holder.cancel()
        asyncio.run(run())
        assert_router_counts_back_to_zero(queued)
        assert_router_counts_back_to_zero(short)
    finally:
        d.procs[queued].stop()
        d.procs[short].stop()


async def until(read, at_least: float, timeout_s: float = 60.0) -> None:
    """Polls the async `read()` until it gives at least `at_least`."""
    deadline = time.monotonic() + timeout_s
    while (value := await read()) < at_least:
        assert time.monotonic() < deadline, f"still {value} after {timeout_s:.0f} s, waiting for {at_least}"
        await asyncio.sleep(0.02)


async def in_flight(client: httpx.AsyncClient, router: str) -> int:
    return (await client.get(f"{router}/health", timeout=5)).json()["in_flight"]


async def line_length(client: httpx.AsyncClient, router: str) -> float:
    """The router's waiting requests over every role, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{router}/metrics", timeout=5)).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "splitserve_router_queued_requests"
               for s in f.samples)


def test_a_stuck_decode_is_ejected_by_its_probe_and_its_request_retried_elsewhere(cluster) -> None:
    """SIGSTOP: the connection stays open, so only the active probe can tell; the request on it
    is retried on the other pair when the probe ejects it, not after the 600 s read timeout."""
    import os
    import signal

    router = cluster["router"]
    want = httpx.post(f"{router}/v1/completions", json=body(600), timeout=120).json()["choices"][0]["token_ids"]
    result: dict = {}
    call = threading.Thread(target=lambda: result.update(r=httpx.post(f"{router}/v1/completions", json=body(600),
                                                                      timeout=120)))
    call.start()
    victim = decoding_on(cluster["decode"])
    pid = cluster["d"].procs[victim].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        call.join(timeout=60)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["choices"][0]["token_ids"] == want
        assert time.monotonic() - started < 15
        assert not backends(router)[victim]["healthy"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while not backends(router)[victim]["healthy"]:  # probed back in once it answers again
        assert time.monotonic() < deadline, backends(router)[victim]
        time.sleep(0.1)
    assert_router_counts_back_to_zero(router)
    for url in [*cluster["prefill"], *cluster["decode"]]:
        assert_kv_back_to_start(url, timeout=20)
