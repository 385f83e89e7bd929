"""Encoder disaggregation with Qwen2.5-VL: 1 or 2 encode + 1 prefill + 1 decode behind the router equal the
unified engine token for token. Each encoder answers with the image's patch grid, the router passes it on in
the image_ref, and prefill and decode take each image's token count and M-RoPE positions from it; the rows
(a different count per image size) land in slots sized for the processor's max_pixels. An encoder killed -9
mid-write is routed around; every page, room and slot comes back.

Real processes on loopback: Mooncake TCP for the rows and the KV."""

from __future__ import annotations

import time

import httpx
import pytest
from server_group import ServerGroup, answer_across_a_kill_mid_write, chat_all, image, png_bytes, png_url
from servers import TEST_CONTROL_KEY, assert_kv_back_to_start, free_port

from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_checkpoint
from splitserve.engine.multimodal.image_items import image_digest
from splitserve.router.backend_pool import Backend
from splitserve.router.image_encoding import encoder_ring
from splitserve.transfer.bootstrap_grant import KEY_HEADER

pytestmark = pytest.mark.slow

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "2048",
          "--max-running-requests", "8"]
TRANSFER = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "4",
            "--transfer-control-key", TEST_CONTROL_KEY]
CASES = [
    [{"type": "text", "text": "plain text, no encoder"}],
    [image(png_url(57, 40, 1)), {"type": "text", "text": "describe"}],
    [image(png_url(31, 90, 2)), {"type": "text", "text": "describe"}],
    [{"type": "text", "text": "two"}, image(png_url(150, 120, 3)), image(png_url(10, 6, 4, "WEBP"))],
    [image(png_url(57, 40, 1)), {"type": "text", "text": "the first image again"}],
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen-vl-epd")
    d = ServerGroup(tmp, write_qwen_vl_checkpoint(tmp / "ckpt", seed=5), ENGINE)
    d.engine("unified", "unified", "--chunked-prefill-size", "8")
    for name in ("encode-a", "encode-b"):
        d.engine(name, "encode", *TRANSFER)
    d.engine("encode-slow", "encode", *TRANSFER, env={"SPLITSERVE_EMBEDDING_WRITE_PAUSE_S": "20"})
    d.engine("prefill", "prefill", "--bootstrap-port", str(free_port()), "--chunked-prefill-size", "8",
             "--embedding-timeout-s", "3", *TRANSFER)
    d.engine("decode", "decode", *TRANSFER)
    pd = ["--prefill", d.url("prefill"), "--decode", d.url("decode"), "--health-interval-s", "0.3",
          "--transfer-control-key", TEST_CONTROL_KEY]
    d.start("router-1e", ["router", *pd, "--encode", d.url("encode-a")])
    d.start("router-2e", ["router", *pd, "--encode", d.url("encode-a"), d.url("encode-b")])
    d.start("router-midwrite", ["router", *pd, "--encode", d.url("encode-slow"), d.url("encode-b")])
    try:
        d.wait()
        yield d
    finally:
        d.stop()


def body(parts: list[dict]) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def embedding(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()["embedding"]


def assert_everything_back(d: ServerGroup, timeout: float = 10.0) -> None:
    """Pages, and the prefill's and live encoders' rooms and slots (a slot a dead encoder was writing stays
    fenced until its transfer is written off: waited for)."""
    assert_kv_back_to_start(d.url("prefill"))
    assert_kv_back_to_start(d.url("decode"))
    deadline = time.monotonic() + timeout
    while True:
        pre = embedding(d.url("prefill"))
        encoders = [embedding(d.url(n)) for n in ("encode-a", "encode-b")]
        if (all(pre[k] == 0 for k in ("waiting", "staged", "rooms", "leased", "fenced"))
                and all((e["pinned_slots"], e["rooms"], e["queued"]) == (0, 0, 0) for e in encoders)):
            return
        assert time.monotonic() < deadline, f"embedding resources not back: prefill {pre}, encoders {encoders}"
        time.sleep(0.1)


@pytest.mark.parametrize("router", ["router-1e", "router-2e"])
def test_epd_equals_unified_token_for_token(deployment: ServerGroup, router: str) -> None:
    bodies = [body(c) for c in CASES]
    want = [r.json()["choices"][0] for r in chat_all(deployment.url("unified"), bodies)]
    got = chat_all(deployment.url(router), bodies)
    for case, w, g in zip(CASES, want, got, strict=True):
        assert g.status_code == 200, g.text
        choice = g.json()["choices"][0]
        assert choice["prompt_token_ids"] == w["prompt_token_ids"], case  # each image's own token count
        assert choice["token_ids"] == w["token_ids"], case
    assert_everything_back(deployment)
    cached = embedding(deployment.url("encode-a"))["cached_images"]
    if router == "router-1e":
        assert cached == 4  # every distinct image once: the repeat was a cache hit
    else:
        # b took its share by image hash; if not, the router's view of its encoders says why (an ejection?)
        assert embedding(deployment.url("encode-b"))["cached_images"] > 0, \
            httpx.get(f"{deployment.url(router)}/health", timeout=5).json()["backends"]


def test_an_encoder_answers_each_image_s_grid(deployment: ServerGroup) -> None:
    # On the encoder the next test kills: the rooms opened here are never asked for by a prefill.
    r = httpx.post(f"{deployment.url('encode-slow')}/v1/encode", headers={KEY_HEADER: TEST_CONTROL_KEY},
                   json={"items": [{"room": 7_000_001, "image_url": {"url": png_url(57, 40, 1)}},
                                   {"room": 7_000_002, "image_url": {"url": png_url(31, 90, 2)}}]}, timeout=30)
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    # 57x40 resizes to 56x40 (14 x 10 patches), 31x90 to 32x88 (8 x 22): 35 and 44 merged tokens.
    assert [(i["grid"], i["rows"]) for i in items] == [([1, 10, 14], 35), ([1, 22, 8], 44)]


def test_an_encoder_killed_mid_write_is_retried_on_another_encoder(deployment: ServerGroup) -> None:
    slow, other = deployment.url("encode-slow"), deployment.url("encode-b")
    ring = [Backend(slow, "encode"), Backend(other, "encode")]
    seed = next(s for s in range(200, 300)
                if encoder_ring(ring, image_digest(png_bytes(36, 28, s)))[0].url == slow)  # the slow one takes it
    case = body([image(png_url(36, 28, seed)), {"type": "text", "text": "killed mid-write"}])
    want = chat_all(deployment.url("unified"), [case])[0].json()["choices"][0]["token_ids"]
    free_at_start = embedding(deployment.url("prefill"))["free"]
    r, answered_at, killed_at = answer_across_a_kill_mid_write(deployment, "router-midwrite", case, "encode-slow")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert answered_at - killed_at < 10
    assert_everything_back(deployment)
    assert embedding(deployment.url("prefill"))["free"] == free_at_start
