"""`serve --engine-process` with a multimodal model: image items cross to the engine core process
(msgpack, the pixels and rows as raw bytes with their dtype and shape; no pickle), so a unified
engine, a prefill and a decode serve images in the split, and the encode role's /v1/encode is
answered by the API server process (key check, decoding and preprocessing there) and the core (the
rooms, the tower). Greedy output of every split equals the one-process unified engine token for
token; bad images are 400s; slots, rooms and pages return to their start.

Real processes: a one-process unified reference, and split (API server + core) unified, encode,
prefill and decode engines behind a router; Mooncake TCP on loopback."""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest
import torch
from server_group import ServerGroup, chat_all, image, png_url
from servers import (
    TEST_CONTROL_KEY,
    assert_kv_back_to_start,
    engine_state,
    free_port,
)

from splitserve.api.core_protocol import image_from_wire, image_to_wire
from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.engine.multimodal.image_items import ImageItem
from splitserve.transfer.bootstrap_grant import KEY_HEADER

pytestmark = pytest.mark.slow

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "2048",
          "--max-running-requests", "8", "--chunked-prefill-size", "8"]
TRANSFER = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "4",
            "--transfer-control-key", TEST_CONTROL_KEY]


def body(parts: list[dict], **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


CASES = [
    [{"type": "text", "text": "plain text"}],
    [image(png_url(40, 30, 1)), {"type": "text", "text": "describe"}],
    [image(png_url(25, 60, 2, "JPEG")), {"type": "text", "text": "describe"}],
    [{"type": "text", "text": "two"}, image(png_url(90, 70, 3)), image(png_url(33, 33, 4, "WEBP"))],
    [image(png_url(40, 30, 1)), {"type": "text", "text": "the first image again"}],
]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-process-images")
    p = ServerGroup(tmp, write_llava_checkpoint(tmp / "ckpt", seed=7), ENGINE)
    p.engine("one-process", "unified")
    p.engine("unified", "unified", "--engine-process")
    # A room no prefill asks for (the 409 test's) is closed after the bootstrap timeout.
    p.engine("encode", "encode", "--engine-process", *TRANSFER, "--transfer-bootstrap-timeout-s", "3")
    p.engine("prefill", "prefill", "--engine-process", "--bootstrap-port", str(free_port()), *TRANSFER)
    p.engine("decode", "decode", "--engine-process", *TRANSFER)
    p.start("router", ["router", "--prefill", p.url("prefill"), "--decode", p.url("decode"), "--encode",
                       p.url("encode"), "--health-interval-s", "0.3", "--transfer-control-key", TEST_CONTROL_KEY])
    try:
        p.wait()
        for name in ("unified", "encode", "prefill", "decode"):  # each really is an API server and a core
            key = "" if name == "unified" else TEST_CONTROL_KEY
            assert engine_state(p.url(name), key=key)["engine_core_pid"] != p.procs[name][1].proc.pid
        yield p
    finally:
        p.stop()


def choices(responses: list[httpx.Response]) -> list[list[list[int]]]:
    for r in responses:
        assert r.status_code == 200, r.text
    return [[c["token_ids"] for c in r.json()["choices"]] for r in responses]


def embedding_idle(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()["embedding"]


def test_an_image_item_round_trips_the_wire_as_bytes() -> None:
    pixels = torch.randn(3, 8, 6)
    rows = torch.randn(5, 4).to(torch.bfloat16)
    items = [ImageItem("ab" * 32, 7, 5, pixels=pixels), ImageItem("cd" * 32, 20, 5, embedding=rows),
             ImageItem("ef" * 32, 30, 5, encoder_addr="tcp://127.0.0.1:5", room=2**62)]
    wire = msgpack.unpackb(msgpack.packb([image_to_wire(i) for i in items], use_bin_type=True), raw=False)
    back = [image_from_wire(row) for row in wire]
    assert torch.equal(back[0].pixels, pixels) and back[0].embedding is None
    assert back[1].embedding.dtype == torch.bfloat16 and torch.equal(back[1].embedding, rows)
    for a, b in zip(items, back, strict=True):
        assert a.describe() == b.describe()
    assert back[2].pixels is None and back[2].embedding is None


def test_a_unified_split_engine_equals_the_one_process_engine_token_for_token(group: ServerGroup) -> None:
    bodies = [body(c) for c in CASES] + [body(CASES[1], n=2, temperature=0.8, seed=3)]
    want = choices(chat_all(group.url("one-process"), bodies))
    got = choices(chat_all(group.url("unified"), bodies))
    assert got == want
    assert_kv_back_to_start(group.url("unified"), key="")


def test_encode_prefill_and_decode_split_engines_equal_the_one_process_engine(group: ServerGroup) -> None:
    bodies = [body(c) for c in CASES]
    want = choices(chat_all(group.url("one-process"), bodies))
    got = choices(chat_all(group.url("router"), bodies))
    assert got == want
    enc = embedding_idle(group.url("encode"))
    assert enc["cached_images"] == 4  # every distinct image once: the repeat was a cache hit in the core
    for name in ("prefill", "decode"):
        assert_kv_back_to_start(group.url(name))
    pre = embedding_idle(group.url("prefill"))
    assert pre["staged"] == 0 and pre["leased"] == 0 and pre["fenced"] == 0 and pre["waiting"] == 0, pre
    assert enc["pinned_slots"] == 0 and enc["rooms"] == 0 and enc["queued"] == 0, enc


def test_the_split_encoder_checks_key_items_and_images_before_the_core(group: ServerGroup) -> None:
    url = f"{group.url('encode')}/v1/encode"
    item = {"items": [{"room": 5, "image_url": {"url": png_url(20, 20, 5)}}]}
    r = httpx.post(url, json=item, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    for bad, code in (({"items": []}, None), ({"items": [{"room": 6, "image_url": {"url": "data:image/png;base64,@"}}]},
                                              "invalid_image")):
        r = httpx.post(url, json=bad, headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)
        assert r.status_code == 400, r.text
        assert code is None or r.json()["error"]["code"] == code, r.text
    ok = httpx.post(url, json={"items": [{"room": 7, "image_url": {"url": png_url(20, 20, 5)}}]},
                    headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)
    assert ok.status_code == 200 and ok.json()["items"][0]["rows"] > 0, ok.text
    again = httpx.post(url, json={"items": [{"room": 7, "image_url": {"url": png_url(20, 20, 5)}}]},
                       headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)
    assert again.status_code == 409 and "already open" in again.text, again.text
    deadline = time.monotonic() + 15
    while (enc := embedding_idle(group.url("encode")))["rooms"] or enc["pinned_slots"] or enc["queued"]:
        assert time.monotonic() < deadline, f"the unasked room was never closed: {enc}"
        time.sleep(0.1)


def test_a_split_encoder_call_with_a_taken_room_opens_none_of_its_rooms(group: ServerGroup) -> None:
    """All or nothing in the core too: the 409 for the second item leaves the first item's room closed."""
    url = f"{group.url('encode')}/v1/encode"

    def call(rooms: list[int]) -> httpx.Response:
        items = [{"room": room, "image_url": {"url": png_url(20, 20 + i, 40 + i)}} for i, room in enumerate(rooms)]
        return httpx.post(url, json={"items": items}, headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)

    start = embedding_idle(group.url("encode"))
    r = call([11, 11])  # the second item's room is the first's
    assert r.status_code == 409 and "room 11 is already open" in r.text, r.text
    assert embedding_idle(group.url("encode"))["rooms"] == start["rooms"]
    assert call([12]).status_code == 200
    r = call([13, 12])  # the second item's room is open from the call before
    assert r.status_code == 409 and "room 12 is already open" in r.text, r.text
    # Room 12 only (or none, if its 3 s bootstrap timeout already closed it): room 13 was never opened.
    assert embedding_idle(group.url("encode"))["rooms"] <= start["rooms"] + 1


def test_bad_images_are_400s_in_the_split(group: ServerGroup) -> None:
    r = httpx.post(f"{group.url('unified')}/v1/chat/completions", timeout=30,
                   json=body([image("data:image/png;base64,@@@"), {"type": "text", "text": "x"}]))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
    assert_kv_back_to_start(group.url("unified"), key="")
