"""Qwen2.5-VL served over real HTTP: the unified engine's greedy output equals transformers `generate` for
concurrent requests with 0, 1 and 2 images of several sizes (the engine templates, preprocesses and places each
image's own token count; decode steps rotate at index + delta), and prefill + decode behind the router (Mooncake
TCP on loopback: the decode side builds its positions from the images' grids) and a unified engine at tensor
parallel 2 (CPU, gloo) equal it token for token. Every engine's pages come back."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from servers import TEST_CONTROL_KEY, LocalDeployment, assert_kv_back_to_start, engine_state, wait_http_ok

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_checkpoint
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.multimodal.image_items import expand_image_tokens
from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor
from splitserve.transfer.bootstrap_grant import KEY_HEADER

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--served-model-name", "m", "--page-size", "4", "--max-total-tokens", "2048",
               "--max-running-requests", "8", "--device", "cpu", "--chunked-prefill-size", "16"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "5"]
MAX_TOKENS = 10


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PICTURES = [picture(57, 40, 1), picture(31, 90, 2), picture(150, 120, 3), picture(10, 6, 4)]
CASES = [  # content parts; images as indices into PICTURES
    ["no image at all, just text"],
    [0, "describe"],
    [1, "describe"],  # same text, another image (another grid): no KV shared past the text
    ["two:", 2, 3],
    [0, "describe it again"],  # the first image again: a prefix-cache hit past it
]


def parts(case: list) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": png_url(PICTURES[p])}} if isinstance(p, int)
            else {"type": "text", "text": p} for p in case]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen2.5-vl") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory):
    d = LocalDeployment(tmp_path_factory.mktemp("qwen-vl-serving"), checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        engines = {"unified": d.engine("unified"), "unified-tp2": d.engine("unified", "--tp-size", "2"),
                   "prefill": d.engine("prefill"), "decode": d.engine("decode")}
        d.wait(list(engines.values()))
        router = d.router([engines["prefill"]], [engines["decode"]], "--health-interval-s", "0.3")
        wait_http_ok(f"{router}/ready", d.procs[router].proc, 60, d.procs[router].log)
        yield {**engines, "router": router}
    finally:
        d.stop()


def greedy(url: str) -> list[dict]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": parts(case)}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}) for case in CASES))

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def hf_greedy(checkpoint: Path, case: list) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for the prompt rendered by the checkpoint's chat template, each image's
    placeholder widened to its grid's token count (test_qwen_vl holds the patches and positions equal)."""
    mc = ModelConfig.from_folder(checkpoint)
    tok = TextTokenizer(checkpoint)
    hf_parts = [{"type": "image"} if isinstance(p, int) else {"type": "text", "text": p} for p in case]
    text = transformers.AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        [{"role": "user", "content": hf_parts}], add_generation_prompt=True, tokenize=False)
    proc = QwenVLImageProcessor.from_folder(checkpoint)
    # The picture as the server decodes it: PNG is lossless.
    images = [proc(PICTURES[p]) for p in case if isinstance(p, int)]
    ids, _ = expand_image_tokens(tok.encode(text, add_special_tokens=False), mc.vision.image_token_id,
                                 [mc.vision.tokens_for_grid(i.grid) for i in images], len(images))
    inputs = {"input_ids": torch.tensor([ids]),
              "mm_token_type_ids": (torch.tensor([ids]) == mc.vision.image_token_id).int()}
    if images:
        inputs["pixel_values"] = torch.cat([i.patches for i in images])
        inputs["image_grid_thw"] = torch.tensor([i.grid for i in images])
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config)
    return ids, out[0, len(ids):].tolist()


def test_unified_equals_transformers_generate(cluster, checkpoint: Path) -> None:
    got = greedy(cluster["unified"])
    for case, resp in zip(CASES, got, strict=True):
        want_prompt, want_tokens = hf_greedy(checkpoint, case)
        choice = resp["choices"][0]
        assert choice["prompt_token_ids"] == want_prompt, case
        assert choice["token_ids"] == want_tokens, case
    # Same prompt again: cached past its image, same tokens.
    again = greedy(cluster["unified"])
    assert [r["choices"][0]["token_ids"] for r in again] == [r["choices"][0]["token_ids"] for r in got]
    assert again[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert_kv_back_to_start(cluster["unified"])


def test_prefill_decode_and_tp2_equal_unified_token_for_token(cluster) -> None:
    want = [r["choices"][0]["token_ids"] for r in greedy(cluster["unified"])]
    for name in ("router", "unified-tp2"):
        assert [r["choices"][0]["token_ids"] for r in greedy(cluster[name])] == want, name
    for name in ("unified", "unified-tp2", "prefill", "decode"):
        assert_kv_back_to_start(cluster[name])


def test_a_prefill_with_images_switched_to_decode_and_back_keeps_its_receivers_and_its_outputs(cluster) -> None:
    """Its KV endpoint and its embedding receiver are handed to the decode role (which carries the receiver) and
    back: the same Mooncake session and receiver endpoint after the round trip, and the router's greedy outputs
    still the unified engine's. Runs last: the group has no prefill while it decodes."""
    prefill, router = cluster["prefill"], cluster["router"]
    before = httpx.get(f"{prefill}/health", timeout=5).json()["embedding_receiver"]
    session = engine_state(prefill)["kv_transfer_session"]
    for role in ("decode", "prefill"):
        r = httpx.post(f"{prefill}/internal/role", headers={KEY_HEADER: TEST_CONTROL_KEY},
                       json={"role": role, "settle_s": 0.4}, timeout=60)
        assert r.status_code == 200 and r.json()["switched"], r.text
    assert httpx.get(f"{prefill}/health", timeout=5).json()["embedding_receiver"] == before
    assert engine_state(prefill)["kv_transfer_session"] == session
    want = [r["choices"][0]["token_ids"] for r in greedy(cluster["unified"])]
    for _ in range(100):  # the router moves it back to prefill within a few probes (every 0.3 s)
        backends = httpx.get(f"{router}/health", timeout=5).json()["backends"]
        if any(b["url"] == prefill and b["role"] == "prefill" and b["healthy"] and not b["engine_draining"]
               for b in backends):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the router never routed {prefill} as prefill again: {backends}")
    assert [r["choices"][0]["token_ids"] for r in greedy(router)] == want
    for name in ("prefill", "decode"):
        assert_kv_back_to_start(cluster[name])
