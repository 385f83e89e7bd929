"""--host-kv-tokens on prefill and decode engines (real processes, Mooncake TCP on loopback, behind the
router): a multi-turn load whose prefixes overflow both engines' device KV gives the unified engine's
greedy tokens, and both tiers serve hits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--page-size", "4", "--max-running-requests", "4", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "5"]
SMALL_KV = ["--max-total-tokens", "128", "--host-kv-tokens", "1024"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


async def generate(url: str, prompt: list[int]) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


def test_prefill_and_decode_with_the_host_tier_match_the_unified_engine(tmp_path: Path) -> None:
    d = LocalDeployment(tmp_path, write("llama-gqa-llama3rope", tmp_path / "ckpt"), ENGINE_ARGS, TRANSFER_ARGS)
    try:
        unified = d.engine("unified", "--max-total-tokens", "4096")
        prefill, decode = d.engine("prefill", *SMALL_KV), d.engine("decode", *SMALL_KV)
        d.wait([unified, prefill, decode])
        router = d.router([prefill], [decode])
        d.wait([router], timeout=60)
        gen = torch.Generator().manual_seed(21)
        convs = [torch.randint(0, 256, (48,), generator=gen).tolist() for _ in range(5)]
        for _ in range(3):
            convs = [[*c, *torch.randint(0, 256, (5,), generator=gen).tolist()] for c in convs]
            for c in convs:
                assert asyncio.run(generate(router, c)) == asyncio.run(generate(unified, c))
        for url in (prefill, decode):
            assert metric(url, "splitserve_host_kv_hit_tokens_total") > 0, url
            assert metric(url, "splitserve_host_kv_pages") <= 1024 // 4
            assert_kv_back_to_start(url)
    finally:
        d.stop()
