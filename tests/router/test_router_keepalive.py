"""Pooled keep-alive connections to engines: the router neither drops requests nor ejects a healthy
engine when an engine closes a connection that sat idle in the router's pool.

An engine (uvicorn) closes a keep-alive connection 5 s after its last answer; httpx, unless told
otherwise, keeps an idle connection for 5 s too, counted from when the answer reached the router.
A connection the router takes from its pool within that difference (the answer's way from the
engine to the router) meets the engine's close on the wire: the request gets a reset or a closed
socket before any answer byte. On loopback the difference is well under a millisecond, so
`KeepAliveRelay` stretches it: between the router and a real engine it delays the engine's bytes
by `latency_s` (a far engine), and when the engine closes a connection it keeps the router's side
open until the router writes on it again, then resets it (what a close in flight does to a request).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import ServerProcess, free_port, wait_http_ok

ENGINE_KEEPALIVE_S = 5.0  # uvicorn's default timeout_keep_alive, which the engines run with
ENGINE_ARGS = ["--model", "tiny", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "16384",
               "--max-running-requests", "64"]
BODY = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.slow


class KeepAliveRelay:
    """A loopback TCP relay in front of one engine (see the module's docstring). ``crossed`` counts
    the router's writes on connections the engine had closed; ``reset_posts(k)`` resets the next k
    POST requests on arrival (the engine never sees them)."""

    def __init__(self, target_port: int, latency_s: float = 0.0) -> None:
        self.port, self.target_port, self.latency_s = free_port(), target_port, latency_s
        self.crossed = self.injected = self.connections = 0
        self._posts_to_reset = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_posts(self, k: int) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "_posts_to_reset", k)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            engine_r, engine_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            self._reset(client_w)
            return
        engine_closed = asyncio.Event()

        answers: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def engine_to_relay() -> None:
            with contextlib.suppress(OSError):
                while data := await engine_r.read(65536):
                    answers.put_nowait((time.monotonic() + self.latency_s, data))
            engine_closed.set()  # held: the router's side stays open, as if the close were still on its way

        async def relay_to_client() -> None:
            with contextlib.suppress(OSError):
                while True:
                    due, data = await answers.get()
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    client_w.write(data)
                    await client_w.drain()

        pumps = [asyncio.ensure_future(engine_to_relay()), asyncio.ensure_future(relay_to_client())]
        reset = False
        try:
            while data := await client_r.read(65536):
                if engine_closed.is_set():
                    self.crossed += 1
                    reset = True
                    return
                if self._posts_to_reset and data.startswith(b"POST "):
                    self._posts_to_reset -= 1
                    self.injected += 1
                    reset = True
                    return
                engine_w.write(data)
                await engine_w.drain()
        except OSError:
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            engine_w.close()
            if reset:
                self._reset(client_w)
            else:
                client_w.close()


@pytest.fixture
def engine(tmp_path: Path):
    port = free_port()
    proc = ServerProcess(["serve", *ENGINE_ARGS, "--port", str(port)], tmp_path / "engine.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc.proc, 120, proc.log)
        yield port, proc
    finally:
        proc.stop()


@contextlib.contextmanager
def router_over(tmp_path: Path, unified: list[str], *extra: str):
    port = free_port()
    proc = ServerProcess(["router", "--port", str(port), "--unified", *unified, *extra],
                         tmp_path / f"router-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/ready", proc.proc, 60, proc.log)
        yield url, proc
    finally:
        proc.stop()


def client() -> httpx.AsyncClient:
    # The router is a uvicorn server too: this client lets go of idle connections well before it does.
    return httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None, keepalive_expiry=1.0))


async def burst(c: httpx.AsyncClient, router: str, n: int) -> list[int]:
    rs = await asyncio.gather(*(c.post(f"{router}/v1/completions", json=BODY) for _ in range(n)))
    return [r.status_code for r in rs]


def burst_gap_then_requests(router: str, gap_s: float) -> tuple[list[int], list[str]]:
    """A burst that leaves many idle connections in the router's pool, an idle gap, then requests."""
    async def run() -> tuple[list[int], list[str]]:
        async with client() as c:
            assert await burst(c, router, 48) == [200] * 48
            await asyncio.sleep(gap_s)
            codes, errors = [], []
            for _ in range(3):  # concurrent requests after the gap, then a few one at a time
                rs = await asyncio.gather(*(c.post(f"{router}/v1/completions", json=BODY) for _ in range(16)))
                codes += [r.status_code for r in rs]
                errors += [r.text[:200] for r in rs if r.status_code != 200]
            for _ in range(8):
                r = await c.post(f"{router}/v1/completions", json=BODY)
                codes.append(r.status_code)
                if r.status_code != 200:
                    errors.append(r.text[:200])
                await asyncio.sleep(0.1)
            return codes, errors
    return asyncio.run(run())


def backend_state(router: str) -> dict:
    return httpx.get(f"{router}/health", timeout=5).json()["backends"][0]


LATENCY_S = 1.5  # the relay's engine-to-router delay: the window in which a pooled connection is dead


def test_requests_after_an_idle_gap_longer_than_the_engines_keepalive_all_succeed(engine, tmp_path) -> None:
    """The repro: a burst, an idle gap past the engine's keep-alive (counted from the engine's last
    answers; the router got them LATENCY_S later), requests. Before the router let go of idle
    connections before the engine does and retried a dead pooled one on a fresh connection, the
    first request on a connection the engine had closed ejected the only engine and the others got
    503 ("request failed on every backend tried", "no healthy unified backend")."""
    relay = KeepAliveRelay(engine[0], latency_s=LATENCY_S)
    try:
        with router_over(tmp_path, [relay.url], "--health-timeout-s", "5") as (router, _):
            codes, errors = burst_gap_then_requests(router, ENGINE_KEEPALIVE_S - LATENCY_S / 2)
            state = backend_state(router)
        assert codes.count(200) == len(codes), (f"{len(codes) - codes.count(200)} of {len(codes)} failed: "
                                                f"{errors[:3]}; {state}; {relay.crossed} crossed closes")
        assert state["ejections"] == 0, state
        # The router let go of the burst's connections before the engine closed them.
        assert relay.crossed == 0
    finally:
        relay.close()


def test_a_request_on_a_pooled_connection_the_engine_closed_is_sent_again_on_a_fresh_one(engine, tmp_path) -> None:
    """With the router keeping idle connections past the engine's keep-alive, the requests after the
    gap do meet connections the engine closed: each is sent once more on a fresh connection, and
    the engine stays in rotation."""
    relay = KeepAliveRelay(engine[0], latency_s=LATENCY_S)
    try:
        with router_over(tmp_path, [relay.url], "--health-timeout-s", "5",
                         "--upstream-keepalive-expiry-s", "30") as (router, _):
            codes, errors = burst_gap_then_requests(router, ENGINE_KEEPALIVE_S - LATENCY_S / 2)
            state = backend_state(router)
            metrics = httpx.get(f"{router}/metrics", timeout=5).text
        assert relay.crossed > 0  # the scenario happened
        assert codes.count(200) == len(codes), f"{len(codes) - codes.count(200)} failed: {errors[:3]}; {state}"
        assert state["ejections"] == 0, state
        retried = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("splitserve_router_dead_connection_retries "))
        assert retried >= relay.crossed > 0
    finally:
        relay.close()


def test_the_last_engine_is_not_ejected_for_a_failed_request_but_its_probe_decides(engine, tmp_path) -> None:
    """Two resets in a row (a dead pooled connection and then a fresh one) fail a request on the only
    engine: it is probed at once instead of ejected, the probe passes, and the request is retried
    there. An engine that is really gone is ejected by its probe, and requests get a 503 once they have waited
    --backend-wait-s for it to come back."""
    port, proc = engine
    relay = KeepAliveRelay(port)
    try:
        with router_over(tmp_path, [relay.url], "--backend-wait-s", "2") as (router, _):
            assert httpx.post(f"{router}/v1/completions", json=BODY, timeout=60).status_code == 200
            relay.reset_posts(2)
            r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
            assert relay.injected == 2
            state = backend_state(router)
            assert state["healthy"] and not state["suspect"] and state["ejections"] == 0, state

            proc.kill()
            started = time.monotonic()
            r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "waited 2 s for one" in r.text, r.text
            assert 2 <= time.monotonic() - started < 10
            state = backend_state(router)
            assert not state["healthy"] and state["ejections"] == 1, state
            ready = httpx.get(f"{router}/ready", timeout=5)
            assert ready.status_code == 503 and ready.json()["summary"] == "0 healthy unified"
    finally:
        relay.close()
