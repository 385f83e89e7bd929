"""Fenced embedding slots are bounded, like fenced KV pages: an encoder SIGSTOPped halfway through
an item's write (``SPLITSERVE_EMBEDDING_WRITE_PAUSE_S``) fails its items on the prefill, whose slots stay
fenced while it is frozen; past ``--transfer-fence-max-fraction`` of the prefill's slots, a new
image item for that encoder fails at once with a clear error (``splitserve_embedding_items_refused``)
instead of taking another slot, while items for other encoders go on, token for token as the
unified engine. After SIGCONT the fences lift, the encoder is served again, and every slot, room
and page is back to its start.

Real processes: a unified reference, a prefill with 4 slots (bound 1), a decode, a slow encoder (to
freeze) and a healthy one; Mooncake TCP on loopback.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import threading
import time

import httpx
import pytest
from server_group import ServerGroup, png_url
from servers import (
    TEST_CONTROL_KEY,
    assert_kv_back_to_start,
    bootstrap_grant,
    free_port,
)

from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.transfer.bootstrap_grant import KEY_HEADER

pytestmark = pytest.mark.slow

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "1024",
          "--max-running-requests", "4"]
TRANSFER = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "4",
            "--transfer-control-key", TEST_CONTROL_KEY]
HEARTBEAT_TIMEOUT_S = 0.3 * 4
SLOTS, MAX_FRACTION = 4, "0.25"  # at most 1 slot fenced before a holding encoder is refused
WRITE_PAUSE_S = 3.0  # the freeze lands in this pause; the resumed encoder's later items take it too


def body(parts: list[dict]) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"no {name} at {url}"
    return float(match.group(1))


def encode(encoder: str, url: str) -> dict:
    """Hands the encoder one image for a fresh room, as the router does: the prompt's image_ref."""
    room = secrets.randbits(63)
    r = httpx.post(f"{encoder}/v1/encode", json={"items": [{"room": room, "image_url": {"url": url}}]},
                   headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)
    assert r.status_code == 200, r.text
    return {"type": "image_ref", "image_ref": {"digest": r.json()["items"][0]["digest"],
                                               "encoder_addr": r.json()["endpoint"], "room": room}}


def unasked_ref(encoder_endpoint: str) -> dict:
    """An image_ref for a room the (frozen) encoder was never handed: its rows never come."""
    return {"type": "image_ref", "image_ref": {"digest": "ab" * 32, "encoder_addr": encoder_endpoint,
                                               "room": secrets.randbits(63)}}


def split(g: ServerGroup, bootstrap_port: int, parts: list[dict]) -> tuple[httpx.Response, httpx.Response, float]:
    """The request sent to the prefill and the decode at once, as the router would: both answers and
    how long the prefill's took."""
    req = {**body(parts), **bootstrap_grant("127.0.0.1", bootstrap_port, secrets.randbits(63))}

    async def both() -> tuple[httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = time.monotonic()

            async def prefill() -> tuple[httpx.Response, float]:
                r = await client.post(f"{g.url('prefill')}/v1/chat/completions", json=req)
                return r, time.monotonic() - started
            (pre, took), dec = await asyncio.gather(prefill(),
                                                    client.post(f"{g.url('decode')}/v1/chat/completions", json=req))
            return pre, dec, took
    return asyncio.run(both())


def wait_fenced(prefill: str, n: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (emb := health(prefill)["embedding"])["fenced"] != n:
        assert time.monotonic() < deadline, f"never {n} fenced: {emb}"
        time.sleep(0.05)
    return emb


def test_past_the_fence_bound_a_frozen_encoder_s_new_items_fail_at_once_and_others_go_on(tmp_path) -> None:
    g = ServerGroup(tmp_path, write_llava_checkpoint(tmp_path / "ckpt", seed=7), ENGINE)
    bootstrap_port = free_port()
    try:
        g.engine("unified", "unified")
        g.engine("prefill", "prefill", "--bootstrap-port", str(bootstrap_port), "--embedding-slots", str(SLOTS),
                 "--transfer-fence-max-fraction", MAX_FRACTION, "--embedding-timeout-s", "20", *TRANSFER)
        g.engine("decode", "decode", *TRANSFER)
        g.engine("slow", "encode", *TRANSFER, env={"SPLITSERVE_EMBEDDING_WRITE_PAUSE_S": str(WRITE_PAUSE_S)})
        g.engine("healthy", "encode", *TRANSFER)
        g.wait()
        prefill, decode = g.url("prefill"), g.url("decode")
        start = health(prefill)["embedding"]
        assert start["free"] == SLOTS and start["fenced"] == 0
        refused_at_start = metric(prefill, "splitserve_embedding_items_refused_total")
        frozen_endpoint = health(g.url("slow"))["embedding_endpoint"]
        images = [png_url(40, 30, 1), png_url(33, 41, 2), png_url(29, 35, 3)]
        want = [httpx.post(f"{g.url('unified')}/v1/chat/completions", timeout=60, json=body(
            [{"type": "image_url", "image_url": {"url": u}}, {"type": "text", "text": "describe"}])).json()
            ["choices"][0]["token_ids"] for u in images]

        # 1. The slow encoder frozen halfway through an item's write: the item fails, its slot is fenced.
        parts = [encode(g.url("slow"), images[0]), {"type": "text", "text": "describe"}]
        first: list[tuple[httpx.Response, httpx.Response, float]] = []
        sender = threading.Thread(target=lambda: first.append(split(g, bootstrap_port, parts)))
        sender.start()
        deadline = time.monotonic() + 60
        while health(g.url("slow"))["embedding"]["partly_written"] == 0:
            assert time.monotonic() < deadline, "the slow encoder never got an item partly written"
            time.sleep(0.02)
        os.kill(g.pid("slow"), signal.SIGSTOP)
        try:
            sender.join(timeout=30)
            (pre, dec, _), = first
            assert pre.status_code == 503 and "stopped answering" in pre.text, pre.text
            assert dec.status_code == 503, dec.text
            wait_fenced(prefill, 1)
            # 2. At the bound (1 fenced): the frozen encoder still gets a slot, fails it, fences it.
            pre, dec, _ = split(g, bootstrap_port, [unasked_ref(frozen_endpoint), {"type": "text", "text": "x"}])
            assert pre.status_code == 503 and "stopped answering" in pre.text, pre.text
            assert dec.status_code == 503, dec.text
            wait_fenced(prefill, 2)
            # 3. Past it: the frozen encoder's next item fails at once, takes no slot, is counted.
            pre, dec, took = split(g, bootstrap_port, [unasked_ref(frozen_endpoint), {"type": "text", "text": "x"}])
            assert pre.status_code == 503, pre.text
            message = pre.json()["error"]["message"]
            assert f"encoder {frozen_endpoint} holds 2 embedding slots" in message and "fenced" in message, message
            assert dec.status_code == 503, dec.text  # told at once (abort_room)
            assert took < HEARTBEAT_TIMEOUT_S, f"refused after {took:.2f} s: it waited for the heartbeat timeout"
            assert metric(prefill, "splitserve_embedding_items_refused_total") == refused_at_start + 1
            emb = health(prefill)["embedding"]
            assert emb["fenced"] == 2 and emb["free"] == SLOTS - 2 and emb["leased"] == 0, emb
            # 4. Items for another encoder go on meanwhile, token for token as the unified engine.
            for k in (1, 2):
                pre, dec, _ = split(g, bootstrap_port, [encode(g.url("healthy"), images[k]),
                                                        {"type": "text", "text": "describe"}])
                assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
                assert dec.json()["choices"][0]["token_ids"] == want[k]
            assert health(prefill)["embedding"]["fenced"] == 2, "a fence lifted while the encoder was frozen"
        finally:
            os.kill(g.pid("slow"), signal.SIGCONT)
        # 5. Resumed, it answers the repeated aborts: the fences lift and it is served again.
        resumed = time.monotonic()
        wait_fenced(prefill, 0)
        print(f"2 embedding slots fenced, lifted {time.monotonic() - resumed:.2f}s after SIGCONT")
        pre, dec, _ = split(g, bootstrap_port, [encode(g.url("slow"), images[0]), {"type": "text", "text": "describe"}])
        assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
        assert dec.json()["choices"][0]["token_ids"] == want[0]
        assert metric(prefill, "splitserve_embedding_slots_fenced") == 0
        deadline = time.monotonic() + 10
        while (emb := health(prefill)["embedding"]) != start:
            assert time.monotonic() < deadline, f"embedding resources not back: {emb}, at start {start}"
            time.sleep(0.05)
        for name in ("slow", "healthy"):
            enc = health(g.url(name))["embedding"]
            assert enc["pinned_slots"] == 0 and enc["rooms"] == 0 and enc["queued"] == 0, (name, enc)
        assert_kv_back_to_start(prefill)
        assert_kv_back_to_start(decode)
    finally:
        g.stop()
