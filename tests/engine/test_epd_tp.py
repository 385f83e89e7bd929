"""Images with tensor parallelism (2 CPU processes over gloo): 1 encode + 1 prefill (TP=2) + 1 decode
behind the router, and a unified engine at TP=2 encoding its own images, equal the unified engine
at TP=1 token for token; every engine's pages and embedding slots return to their start.

Rank 0 of the prefill receives the rows from the encoder; they reach rank 1 with the step's batch
(ForwardBatch.image_rows), and each rank writes them over its own token embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from servers import TEST_CONTROL_KEY, LocalDeployment, assert_kv_back_to_start, engine_state, wait_http_ok

from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "2048", "--max-running-requests", "8", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "5"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = write_llava_checkpoint(tmp_path_factory.mktemp("llava") / "ckpt", seed=7)
    d = LocalDeployment(tmp_path_factory.mktemp("epd-tp"), checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        engines = {"unified": d.engine("unified"), "unified-tp2": d.engine("unified", "--tp-size", "2"),
                   "encode": d.engine("encode", "--transfer-control-key", TEST_CONTROL_KEY, *TRANSFER_ARGS),
                   "prefill-tp2": d.engine("prefill", "--tp-size", "2"), "decode": d.engine("decode")}
        d.wait(list(engines.values()))
        router = d.router([engines["prefill-tp2"]], [engines["decode"]], "--encode", engines["encode"],
                          "--health-interval-s", "0.3")
        wait_http_ok(f"{router}/ready", d.procs[router].proc, 60, d.procs[router].log)
        yield {**engines, "router": router}
    finally:
        d.stop()


def png_url(w: int, h: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


CASES = [
    [image(png_url(40, 30, 1)), {"type": "text", "text": "describe"}],
    [{"type": "text", "text": "two"}, image(png_url(90, 70, 3)), image(png_url(33, 33, 4))],
    [{"type": "text", "text": "text only"}],
    [image(png_url(61, 47, 5)), image(png_url(61, 47, 5)), {"type": "text", "text": "twice the same"}],
]


def greedy(url: str) -> list[list[int]]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 10, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}) for parts in CASES))
    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["token_ids"] for r in responses]


def test_epd_with_a_tp2_prefill_equals_unified_token_for_token(cluster) -> None:
    want = greedy(cluster["unified"])
    assert greedy(cluster["router"]) == want
    assert len(engine_state(cluster["prefill-tp2"])["tp_worker_pids"]) == 1
    for name in ("prefill-tp2", "decode"):
        assert_kv_back_to_start(cluster[name])
    embedding = httpx.get(f"{cluster['prefill-tp2']}/health", timeout=5).json()["embedding"]
    assert (embedding["waiting"], embedding["staged"], embedding["leased"]) == (0, 0, 0), embedding
    assert httpx.get(f"{cluster['encode']}/health", timeout=5).json()["embedding"]["cached_images"] == 4


def test_a_tp2_unified_engine_encoding_its_own_images_equals_tp1(cluster) -> None:
    assert greedy(cluster["unified-tp2"]) == greedy(cluster["unified"])
    assert_kv_back_to_start(cluster["unified-tp2"])


def test_an_encode_role_at_tp2_is_refused_with_the_way_out(tmp_path) -> None:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.roles import build_role
    from splitserve.transfer import TransferConfig

    checkpoint = write_llava_checkpoint(tmp_path / "ckpt", seed=7)
    with pytest.raises(ValueError, match="scale encode replicas instead"):
        build_role(EngineConfig(model=str(checkpoint), role="encode", tp_size=2, device="cpu"), TransferConfig())
