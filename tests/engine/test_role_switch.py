"""A prefill engine switches to decode and back at runtime (POST /internal/role) while requests flow
through the router: real processes, Mooncake TCP on loopback, the router following the role from /health.
The engine that switches under load runs its engine core in a process of its own (--engine-process, the GPU
default); the error cases' engines run it in-process, and one of them switches too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import TEST_CONTROL_KEY, LocalDeployment, assert_kv_back_to_start, engine_state

from splitserve.transfer.bootstrap_grant import KEY_HEADER

logger = logging.getLogger(__name__)

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "4096", "--max-running-requests", "8", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "5"]
ROUTER_ARGS = ["--health-interval-s", "0.2"]
SETTLE_S = 0.6  # above the router's probe interval: it sees the drain before the role changes
MAX_TOKENS = 10
KEY = {KEY_HEADER: TEST_CONTROL_KEY}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A unified reference and a 2P1D group behind one router."""
    d = LocalDeployment(tmp_path_factory.mktemp("switch"), write("llama-gqa-llama3rope",
                                                                  tmp_path_factory.mktemp("ckpt")),
                        ENGINE_ARGS, TRANSFER_ARGS)
    try:
        unified = d.engine("unified")
        prefill = [d.engine("prefill"), d.engine("prefill", "--engine-process")]
        decode = d.engine("decode")
        d.wait([unified, *prefill, decode])
        router = d.router(prefill, [decode], *ROUTER_ARGS)
        d.wait([router], timeout=60)
        yield {"unified": unified, "prefill": prefill, "decode": decode, "router": router}
    finally:
        d.stop()


def prompts(seed: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 40, (count,), generator=gen)]


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def router_roles(router: str) -> dict[str, str]:
    """url -> role of the router's routable backends."""
    body = httpx.get(f"{router}/health", timeout=5).json()
    return {b["url"]: b["role"] for b in body["backends"]
            if b["healthy"] and not b["draining"] and not b["engine_draining"]}


async def until_routed(router: str, url: str, role: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while router_roles(router).get(url) != role:
        assert time.monotonic() < deadline, f"the router never routed {url} as {role}: {router_roles(router)}"
        await asyncio.sleep(0.05)


def idle_counts(url: str) -> dict:
    s = assert_kv_back_to_start(url)
    return {"kv_capacity": s["kv_capacity"], "free_or_cached": s["kv_free"] + s["kv_cached"],
            "slots_in_use": s["slots_in_use"], "kv_locked": s["kv_locked"], "role_held": s["role_held"]}


def test_prefill_switches_to_decode_and_back_under_load_with_no_failed_request(group) -> None:
    router, unified, moving = group["router"], group["unified"], group["prefill"][1]
    engines = [*group["prefill"], group["decode"]]
    start = {url: idle_counts(url) for url in engines}
    assert all(not any(c["role_held"].values()) for c in start.values()), start
    session = engine_state(moving)["kv_transfer_session"]
    pool = prompts(7, 24)

    async def scenario() -> tuple[list[list[int]], list[tuple[int, httpx.Response]], list[dict], dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            want = [(await complete(client, unified, p)).json()["choices"][0]["token_ids"] for p in pool]
            done: list[tuple[int, httpx.Response]] = []
            stop = asyncio.Event()

            async def user(u: int) -> None:  # one request after another, round the prompt pool
                i = u
                while not stop.is_set():
                    done.append((i % len(pool), await complete(client, router, pool[i % len(pool)])))
                    i += 4
            users = [asyncio.ensure_future(user(u)) for u in range(4)]
            await asyncio.sleep(1.5)
            switches: list[dict] = []
            work: dict = {}
            r = await client.post(f"{moving}/internal/role", headers=KEY,
                                  json={"role": "decode", "group": TEST_CONTROL_KEY, "settle_s": SETTLE_S})
            assert r.status_code == 200, r.text
            switches.append(r.json())
            await until_routed(router, moving, "decode")
            work["decode_session"] = engine_state(moving)["kv_transfer_session"]
            generated = metric(moving, "splitserve_generation_tokens_total")
            await asyncio.sleep(2.0)  # it decodes for the group now
            work["decoded_tokens"] = metric(moving, "splitserve_generation_tokens_total") - generated
            r = await client.post(f"{moving}/internal/role", headers=KEY,
                                  json={"role": "prefill", "settle_s": SETTLE_S})
            assert r.status_code == 200, r.text
            switches.append(r.json())
            await until_routed(router, moving, "prefill")
            computed = metric(moving, "splitserve_prompt_tokens_computed_total")
            await asyncio.sleep(1.5)  # and prefills again
            work["prefilled_tokens"] = metric(moving, "splitserve_prompt_tokens_computed_total") - computed
            stop.set()
            await asyncio.gather(*users)
            return want, done, switches, work

    want, done, switches, work = asyncio.run(scenario())
    failed = [(i, r.status_code, r.text[:200]) for i, r in done if r.status_code != 200]
    assert not failed, failed
    assert len(done) >= 20
    for i, r in done:
        assert r.json()["choices"][0]["token_ids"] == want[i], f"prompt {i}"
    assert [(s["from_role"], s["to_role"], s["switched"]) for s in switches] == [
        ("prefill", "decode", True), ("decode", "prefill", True)]
    assert work["decoded_tokens"] >= MAX_TOKENS and work["prefilled_tokens"] > 0, work
    for s in switches:
        assert s["drain_s"] >= SETTLE_S - 0.05 and s["total_s"] < 30, s
    logger.warning("role switches under load (%d requests): %s", len(done),
                   [{k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in switches])
    assert {url: idle_counts(url) for url in engines} == start
    # Both switches kept the one KV transfer endpoint (its Mooncake engine is never destroyed: a new one
    # per switch would pile up, threads and sockets with it).
    assert engine_state(moving)["role"] == "prefill"
    assert work.pop("decode_session") == session == engine_state(moving)["kv_transfer_session"]


def test_switch_errors(group) -> None:
    moving, decode, unified = group["prefill"][0], group["decode"], group["unified"]

    def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.post(f"{url}/internal/role", json=body, headers=KEY if headers is None else headers, timeout=60)

    r = post(moving, {"role": "encode"})
    assert r.status_code == 400 and "'role' must be one of prefill, decode" in r.json()["error"]["message"]
    assert post(moving, {"role": "decode"}, headers={}).status_code == 401
    r = post(moving, {"role": "decode", "group": "another-groups-key"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_group"
    r = post(unified, {"role": "decode"})
    assert r.status_code == 409 and "a unified engine cannot switch roles" in r.json()["error"]["message"]
    r = post(decode, {"role": "decode"})  # already its role: nothing happens
    assert r.status_code == 200 and r.json()["switched"] is False
    assert post(moving, {"role": "decode", "settle_s": 2, "timeout_s": 1}).status_code == 400

    async def two_at_once() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.ensure_future(client.post(f"{decode}/internal/role", headers=KEY,
                                                      json={"role": "prefill", "settle_s": 1.0}))
            await asyncio.sleep(0.3)
            second = await client.post(f"{decode}/internal/role", headers=KEY, json={"role": "prefill"})
            health = (await client.get(f"{decode}/health")).json()
            assert health["draining"] is True and health["switching_to"] == "prefill", health
            return await first, second

    first, second = asyncio.run(two_at_once())
    assert second.status_code == 409 and second.json()["error"]["code"] == "switch_in_progress"
    assert first.status_code == 200 and first.json()["to_role"] == "prefill", first.text
    r = post(decode, {"role": "decode", "settle_s": 0.3})  # and back: the group keeps its decode
    assert r.status_code == 200 and r.json()["switched"] is True
    assert httpx.get(f"{decode}/health", timeout=5).json() == {"status": "ok", "role": "decode", "draining": False}
