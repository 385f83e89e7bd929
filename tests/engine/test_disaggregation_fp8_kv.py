"""FP8 KV cache through prefill/decode over Mooncake TCP on loopback, behind the router: greedy output of 1P1D
with FP8 KV equals the unified engine's with FP8 KV, the transfer moves e4m3 pages (half the bytes of bfloat16
ones), and an FP8 prefill refuses to pair with a bfloat16 decode, with both dtypes named and every page back."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start

# bfloat16 on the CPU: the pages an FP8 cache halves are 16-bit ones.
ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "4096", "--max-running-requests", "8", "--device", "cpu",
               "--dtype", "bfloat16"]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "30"]
LAYERS, KV_HEADS, HEAD_DIM, PAGE = 3, 2, 16, 4  # the llama-gqa-llama3rope checkpoint's KV shape

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))
    d = LocalDeployment(tmp_path_factory.mktemp("pd"), checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        unified = d.engine("unified", *FP8)
        prefill, decode = d.engine("prefill", *FP8), d.engine("decode", *FP8)
        prefill16, decode16 = d.engine("prefill"), d.engine("decode")
        d.wait([unified, prefill, decode, prefill16, decode16])
        routers = {"fp8": d.router([prefill], [decode]), "bf16": d.router([prefill16], [decode16]),
                   "mixed": d.router([prefill], [decode16])}
        d.wait(list(routers.values()), timeout=60)
        yield {"unified": unified, "prefill": prefill, "decode": decode, "prefill16": prefill16,
               "decode16": decode16, **routers}
    finally:
        d.stop()


def generate(url: str, prompts: list[list[int]], max_tokens: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}) for p in prompts)))
    return asyncio.run(run())


def tokens(responses: list[httpx.Response]) -> list[list[int]]:
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["token_ids"] for r in responses]


def sent_bytes(prefill: str) -> float:
    for line in httpx.get(f"{prefill}/metrics", timeout=5).text.splitlines():
        if line.startswith("splitserve_transfer_bytes_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_1p1d_with_fp8_kv_equals_unified_with_fp8_kv(cluster) -> None:
    prompts = [list(range(7, 7 + n)) for n in (1, 6, 19, 41)] + [[3, 1, 4, 1, 5, 9, 2, 6] * 5]
    want = tokens(generate(cluster["unified"], prompts, 16))
    assert tokens(generate(cluster["fp8"], prompts, 16)) == want
    for url in (cluster["unified"], cluster["prefill"], cluster["decode"]):
        assert_kv_back_to_start(url)


def test_the_transfer_moves_fp8_pages_at_half_the_bytes(cluster) -> None:
    prompt = [11 + i % 97 for i in range(37)]  # 10 pages of 4
    moved = {}
    for shape, prefill in (("fp8", cluster["prefill"]), ("bf16", cluster["prefill16"])):
        before = sent_bytes(prefill)
        tokens(generate(cluster[shape], [prompt], 2))
        moved[shape] = sent_bytes(prefill) - before
    fp8_kv = 10 * 2 * LAYERS * PAGE * KV_HEADS * HEAD_DIM  # one byte an element: K and V of every layer
    # The same aux bytes either side; the 16-bit pages are twice the FP8 ones.
    assert moved["bf16"] - moved["fp8"] == fp8_kv
    assert fp8_kv <= moved["fp8"] < fp8_kv + 1024


def test_fp8_prefill_and_bfloat16_decode_refuse_to_pair_and_give_every_page_back(cluster) -> None:
    responses = generate(cluster["mixed"], [list(range(30)), list(range(5, 18))], 4)
    for r in responses:
        assert r.status_code >= 500, r.text
        assert "dtype expected 'bfloat16', got 'float8_e4m3fn'" in r.text, r.text
    for url in (cluster["prefill"], cluster["decode16"]):
        assert_kv_back_to_start(url)
    # The pair that agrees still works.
    assert tokens(generate(cluster["fp8"], [list(range(30))], 4))
