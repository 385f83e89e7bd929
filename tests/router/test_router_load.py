"""No fault, no failure: 2,000 requests through routers in front of real tiny engines (a unified
replica, and a prefill+decode pair), in bursts, at steady rates and after idle gaps longer than the
engines' keep-alive timeout, must all succeed, with no engine ever ejected.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from servers import TEST_CONTROL_KEY, LocalDeployment, ServerProcess, free_port, wait_http_ok

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "32768", "--max-running-requests", "128",
               "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.5", "--transfer-bootstrap-timeout-s", "60"]

# Per router: (what, value): a burst of n concurrent requests, a steady (rate req/s, n) stretch, or an
# idle gap (s). Gaps past 5 s outlast the engines' keep-alive: every pooled connection is closed by
# the engine (or, as the router now does, let go of first). 1,000 requests each.
SCHEDULE = [("burst", 200), ("gap", 5.5), ("rate", (40, 150)), ("burst", 150), ("gap", 6.0), ("rate", (80, 200)),
            ("gap", 4.0), ("burst", 100), ("gap", 5.2), ("rate", (20, 60)), ("burst", 140)]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    d = LocalDeployment(tmp, "tiny", ENGINE_ARGS, TRANSFER_ARGS)
    unified_router = None
    try:
        unified, prefill, decode = d.engine("unified"), d.engine("prefill"), d.engine("decode")
        d.wait([unified, prefill, decode])
        pair_router = d.router([prefill], [decode])
        port = free_port()
        unified_router = ServerProcess(["router", "--port", str(port), "--unified", unified],
                                       tmp / "router-unified.log")
        unified_url = f"http://127.0.0.1:{port}"
        d.wait([pair_router])
        wait_http_ok(f"{unified_url}/ready", unified_router.proc, 60, unified_router.log)
        yield {"unified": unified_url, "1p1d": pair_router}
    finally:
        if unified_router is not None:
            unified_router.stop()
        d.stop()


def request_for(rng: random.Random) -> tuple[str, dict]:
    """A short request of a random kind: completion or chat, streamed or not, n = 1 or 2."""
    body: dict = {"model": "m", "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.8]),
                  "ignore_eos": True, "seed": rng.randrange(1000)}
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi " * rng.randint(1, 8)}]}
    return "/v1/completions", {**body, "prompt": [rng.randrange(1, 250) for _ in range(rng.randint(3, 24))]}


async def one(c: httpx.AsyncClient, router: str, path: str, body: dict) -> str | None:
    """None if the request got its whole answer, else what went wrong."""
    try:
        if body.get("stream"):
            async with c.stream("POST", f"{router}{path}", json=body) as r:
                if r.status_code != 200:
                    return f"{r.status_code}: {(await r.aread())[:200]!r}"
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
            if lines[-1:] != ["data: [DONE]"] or any('"error"' in ln for ln in lines):
                return f"stream: {lines[-2:]}"
            return None
        r = await c.post(f"{router}{path}", json=body)
        if r.status_code != 200:
            return f"{r.status_code}: {r.text[:200]}"
        if len(json.loads(r.content)["choices"]) != body.get("n", 1):
            return f"choices: {r.text[:200]}"
        return None
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


async def drive(c: httpx.AsyncClient, router: str, seed: int) -> tuple[int, list[str]]:
    rng = random.Random(seed)
    sent, failures = 0, []
    for what, value in SCHEDULE:
        if what == "gap":
            await asyncio.sleep(value)
            continue
        n, interval = (value, 0.0) if what == "burst" else (value[1], 1 / value[0])
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.ensure_future(one(c, router, *request_for(rng))))
            if interval:
                await asyncio.sleep(interval)
        failures += [f for f in await asyncio.gather(*tasks) if f is not None]
        sent += n
    return sent, failures


def test_two_thousand_requests_in_bursts_rates_and_idle_gaps_with_no_fault_all_succeed(routers) -> None:
    async def run() -> list[tuple[int, list[str]]]:
        # The routers are uvicorn servers too (keep-alive 5 s): this client lets go of idle
        # connections well before, so that it does not race their closes itself.
        limits = httpx.Limits(max_connections=None, keepalive_expiry=1.0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return await asyncio.gather(drive(c, routers["unified"], 1), drive(c, routers["1p1d"], 2))

    started = time.monotonic()
    results = asyncio.run(run())
    wall = time.monotonic() - started
    sent = sum(r[0] for r in results)
    failures = [f for r in results for f in r[1]]
    print(f"\nno-fault load: {sent} requests, {len(failures)} failed, {wall:.1f} s")
    assert sent == 2000
    assert not failures, f"{len(failures)} of {sent} failed: {failures[:5]}"
    for router in routers.values():
        health = httpx.get(f"{router}/health", timeout=5).json()
        assert all(b["healthy"] and b["ejections"] == 0 for b in health["backends"]), health["backends"]
        assert health["in_flight"] == 0


def test_router_help_describes_behaviour_and_every_default() -> None:
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-P", "-m", "splitserve", "router", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "Modules:" not in out and "backend_pool" not in out and "pair_routing" not in out
    assert "keep-alive" in out and "probed at once" in out
    options = re.split(r"\n  (?=--)", out.split("options:", 1)[1])[1:]
    assert len(options) > 20
    missing = [o.split()[0] for o in options if "(default" not in o]
    assert not missing, missing
    assert re.search(r"--upstream-keepalive-expiry-s.*?\(default: 3\.0\)", out, re.S)
    assert TEST_CONTROL_KEY not in out
