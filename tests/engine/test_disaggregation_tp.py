"""Prefill and decode of different tensor-parallel sizes (2 CPU processes over gloo, Mooncake TCP
on loopback): each decode rank receives exactly its KV heads, and the greedy output equals the
unified engine's token for token."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start, engine_state, wait_http_ok

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "4096", "--max-running-requests", "8", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "10"]

pytestmark = pytest.mark.slow


class Deployment(LocalDeployment):
    """Engines of given tensor-parallel sizes and one-to-one routers."""

    def __init__(self, tmp: Path, checkpoint: Path) -> None:
        super().__init__(tmp, checkpoint, ENGINE_ARGS, TRANSFER_ARGS)

    def engine(self, role: str, tp_size: int) -> str:  # type: ignore[override]
        return super().engine(role, "--tp-size", str(tp_size))

    def router(self, prefill: str, decode: str, *extra: str) -> str:  # type: ignore[override]
        return super().router([prefill], [decode], *extra)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))  # 2 KV heads
    d = Deployment(tmp_path_factory.mktemp("pd-tp"), checkpoint)
    try:
        engines = {"unified": d.engine("unified", 1),
                   "prefill-tp2": d.engine("prefill", 2), "decode-tp1": d.engine("decode", 1),
                   "prefill-tp1": d.engine("prefill", 1), "decode-tp2": d.engine("decode", 2)}
        d.wait(list(engines.values()))
        routers = {"p2d1": d.router(engines["prefill-tp2"], engines["decode-tp1"]),
                   "p1d2": d.router(engines["prefill-tp1"], engines["decode-tp2"])}
        for url in routers.values():
            wait_http_ok(f"{url}/ready", d.procs[url].proc, 60, d.procs[url].log)
        yield {**engines, **routers}
    finally:
        d.stop()


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (14,), generator=gen).tolist()
    out = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 9)]
    out += [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (2, 7, 30)]
    return out


async def greedy_all(url: str, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        calls = [client.post(f"{url}/v1/completions", json={
            "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for p in batch]
        responses = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["token_ids"] for r in responses]


@pytest.mark.parametrize("shape", ["p2d1", "p1d2"])
def test_greedy_output_with_different_prefill_and_decode_tp_equals_unified(cluster, shape: str) -> None:
    batch = prompts(21)
    want = asyncio.run(greedy_all(cluster["unified"], batch, 12))
    assert asyncio.run(greedy_all(cluster[shape], batch, 12)) == want
    for name in ("prefill-tp2", "decode-tp1", "prefill-tp1", "decode-tp2"):
        assert_kv_back_to_start(cluster[name])
    tp2 = cluster["prefill-tp2"] if shape == "p2d1" else cluster["decode-tp2"]
    assert len(engine_state(tp2)["tp_worker_pids"]) == 1


def test_prefill_worker_killed_mid_prefill_fails_fast_and_frees_pages_on_both_sides(tmp_path: Path) -> None:
    checkpoint = write("llama-gqa-llama3rope", tmp_path / "ckpt")
    d = Deployment(tmp_path, checkpoint)
    try:
        prefill, decode = d.engine("prefill", 2), d.engine("decode", 1)
        d.wait([prefill, decode])
        # The prefill stays broken (its API server answers 503 with a dead worker): the retries' wait for a
        # healthy prefill is kept short, and each request ends with a 503 after it.
        router = d.router(prefill, decode, "--backend-wait-s", "2")
        wait_http_ok(f"{router}/ready", d.procs[router].proc, 60, d.procs[router].log)
        worker = int(engine_state(prefill)["tp_worker_pids"]["1"])
        prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(9)).tolist()
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                calls = [asyncio.ensure_future(client.post(f"{router}/v1/completions", json=body)) for _ in range(3)]
                await asyncio.sleep(1.0)  # the prompts are being prefilled (600 tokens in chunks of 8)
                os.kill(worker, signal.SIGKILL)
                return list(await asyncio.gather(*calls))

        started = time.monotonic()
        responses = asyncio.run(run())
        assert time.monotonic() - started < 30, "requests hung after the prefill's worker died"
        assert all(r.status_code == 503 for r in responses), [r.text for r in responses]
        health = httpx.get(f"{prefill}/health", timeout=5)
        assert health.status_code == 503 and "tensor-parallel rank 1" in health.json()["status"]
        assert_kv_back_to_start(prefill)
        assert_kv_back_to_start(decode, timeout=30)
    finally:
        d.stop()
