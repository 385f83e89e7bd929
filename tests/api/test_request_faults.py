"""One request's fault fails one request: each bad request goes straight to a real engine over
HTTP, then a good one to the same engine, and every KV page comes back.

Real processes: a prefill and a decode engine (Mooncake TCP on loopback, a group key) and a
unified engine with small queue bounds.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start, bootstrap_grant, engine_state

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "2048", "--max-running-requests", "4", "--device", "cpu"]
# Production heartbeats (a peer is dead after 5 s): nothing here is about detecting dead peers.
TRANSFER_ARGS = ["--transfer-bootstrap-timeout-s", "20"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    checkpoint = write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))
    d = LocalDeployment(tmp_path_factory.mktemp("faults"), checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        prefill, decode = d.engine("prefill"), d.engine("decode")
        unified = d.engine("unified", "--max-running-requests", "1", "--max-waiting-requests", "2",
                           "--max-inbox", "2")
        d.wait([prefill, decode, unified])
        info = httpx.get(f"{prefill}/health", timeout=5).json()
        yield {"prefill": prefill, "decode": decode, "unified": unified,
               "host": info["bootstrap_host"], "port": info["bootstrap_port"]}
    finally:
        d.stop()


def body(prompt: list[int], max_tokens: int = 3, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def post(url: str, payload: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=timeout)


def in_background(url: str, payload: dict) -> dict:
    """Posts from a thread; the returned dict gets the response under "r" when it comes."""
    out: dict = {}

    def run() -> None:
        out["r"] = post(url, payload, timeout=120)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def pair(g: dict, room: int, prompt: list[int], max_tokens: int = 3) -> list[int]:
    """A good request through prefill and decode, as the router sends it; returns decode's tokens."""
    meet = bootstrap_grant(g["host"], g["port"], room)
    p = in_background(g["prefill"], body(prompt, max_tokens, **meet))
    r = post(g["decode"], body(prompt, max_tokens, **meet))
    p["thread"].join(60)
    assert p["r"].status_code == 200, p["r"].text
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def all_back(g: dict) -> None:
    for url in (g["prefill"], g["decode"], g["unified"]):
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200, f"{url} is not healthy"
        assert_kv_back_to_start(url, timeout=15)


def test_reused_room_on_prefill_fails_the_second_request_and_not_the_first(group) -> None:
    meet = bootstrap_grant(group["host"], group["port"], 101)
    first = in_background(group["prefill"], body([1, 2, 3, 4, 5], **meet))
    wait_for(lambda: engine_state(group["prefill"])["waiting"] == 1)  # held until its decode comes
    r = post(group["prefill"], body([9, 9, 9], **meet))
    assert r.status_code == 503 and "already has a transfer" in r.json()["error"]["message"], r.text
    assert pair(group, 102, [7, 8, 9]) == pair(group, 103, [7, 8, 9])  # the engine serves on
    # The first request still owns its room: its decode arrives now and it completes.
    decoded = post(group["decode"], body([1, 2, 3, 4, 5], **meet))
    first["thread"].join(60)
    assert first["r"].status_code == 200, first["r"].text
    assert decoded.status_code == 200, decoded.text
    all_back(group)


def test_reused_room_on_decode_fails_the_second_request_and_not_the_first(group) -> None:
    meet = bootstrap_grant(group["host"], group["port"], 201)
    first = in_background(group["decode"], body([4, 3, 2, 1], **meet))
    wait_for(lambda: engine_state(group["decode"])["parked"] == 1)  # pages reserved, metadata sent
    r = post(group["decode"], body([4, 3, 2, 1], **meet))
    assert r.status_code == 503 and "already has a transfer" in r.json()["error"]["message"], r.text
    pair(group, 202, [5, 6])
    prefilled = post(group["prefill"], body([4, 3, 2, 1], **meet))  # the first one's prefill
    first["thread"].join(60)
    assert prefilled.status_code == 200, prefilled.text
    assert first["r"].status_code == 200, first["r"].text
    all_back(group)


@pytest.mark.parametrize("fields", [
    {},  # no bootstrap fields at all
    {"bootstrap_room": 5},  # a room without the prefill's address
    {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1},  # an address without a room
])
def test_missing_bootstrap_fields_fail_the_request_clearly(group, fields: dict) -> None:
    for url in (group["prefill"], group["decode"]):
        r = post(url, body([1, 2], **fields))
        assert 400 <= r.status_code < 500 or r.status_code == 503, r.text
        assert "bootstrap" in r.json()["error"]["message"], r.text
    pair(group, 301, [3, 1, 4])
    all_back(group)


@pytest.mark.parametrize("fields", [
    {"bootstrap_port": "8998"}, {"bootstrap_room": -1}, {"bootstrap_room": 2**64}, {"bootstrap_host": 7},
    {"bootstrap_signature": 12},
])
def test_bootstrap_fields_of_the_wrong_type_get_400(group, fields: dict) -> None:
    meet = {**bootstrap_grant(group["host"], group["port"], 401), **fields}
    for url in (group["prefill"], group["decode"]):
        r = post(url, body([1, 2], **meet))
        assert r.status_code == 400, r.text
    pair(group, 402, [2, 7])
    all_back(group)


def test_unreachable_prefill_fails_the_decode_request_quickly(group) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    started = time.monotonic()
    r = post(group["decode"], body([6, 6, 6], **bootstrap_grant("127.0.0.1", port, 501)))
    elapsed = time.monotonic() - started
    assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"], r.text
    assert elapsed < 5, f"took {elapsed:.1f}s (the bootstrap timeout is 20 s)"
    pair(group, 502, [6, 6, 6])
    all_back(group)


def test_template_and_tokenizer_faults_get_400_and_the_engine_serves_on(group) -> None:
    url = group["unified"]
    for raw in (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                b'{"model": "m", "max_tokens": 2, "messages": [{"role": "tool", "content": "x", "tool_calls": 1}]}',
                b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 lone"}]}',
                b'{"model": "m", "max_tokens": 2, "prompt": "\\udfff\\ud800 lone surrogates"}'):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = httpx.post(f"{url}{path}", content=raw, timeout=30)
        assert r.status_code in (200, 400), r.text
    for payload in (body([1, 2], seed=2**70), body([1, 2], repetition_penalty=1e39), body([1, 2], top_p=0.0)):
        r = post(url, payload)
        assert r.status_code == 400, r.text
    assert post(url, body([1, 2], max_tokens=2)).status_code == 200
    all_back(group)


def test_a_full_queue_answers_503_with_retry_after_and_serves_the_rest(group) -> None:
    url = group["unified"]  # one running request, two waiting, an inbox of two
    # A long request holds the one running slot for the whole burst (a short one could end
    # mid-burst on an idle machine and let a sixth request in), so none of the burst can run.
    long = in_background(url, body([9, 2, 3], max_tokens=1000))
    deadline = time.monotonic() + 30
    while engine_state(url)["running"] < 1:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    results = [in_background(url, body([i + 1, 2, 3], max_tokens=4)) for i in range(9)]
    for res in [long, *results]:
        res["thread"].join(120)
    assert long["r"].status_code == 200, long["r"].text
    codes = [res["r"].status_code for res in results]
    refused = [res["r"] for res in results if res["r"].status_code == 503]
    assert set(codes) <= {200, 503}, codes
    assert len(refused) >= 5, codes  # behind the running one, at most 2 waiting + 2 in the inbox were taken
    for r in refused:
        assert r.headers["retry-after"] == "1", r.headers
        assert r.json()["error"]["code"] == "overloaded", r.text
    assert post(url, body([1, 2], max_tokens=2)).status_code == 200
    all_back(group)


def test_only_signed_bootstrap_fields_are_taken(group) -> None:
    """Only the router, which holds the group's key, may point an engine at a prefill's room."""
    good = bootstrap_grant(group["host"], group["port"], 601)
    forged = [
        {k: v for k, v in good.items() if k != "bootstrap_signature"},  # unsigned
        {**good, "bootstrap_signature": "00" * 32},  # wrong signature
        {**good, "bootstrap_room": 602},  # another room under this room's signature
        {**good, "bootstrap_host": "10.9.8.7"},  # another address (a decode would connect there)
        bootstrap_grant(group["host"], group["port"], 601, key="not-the-group-key"),
    ]
    for fields in forged:
        for url in (group["prefill"], group["decode"]):
            r = post(url, body([1, 2], **fields))
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "bootstrap_not_granted", r.text
    # An engine without a key takes no bootstrap fields at all.
    r = post(group["unified"], body([1, 2], **good))
    assert r.status_code == 403 and "no --transfer-control-key" in r.json()["error"]["message"], r.text
    pair(group, 601, [1, 2])
    all_back(group)


def test_internal_routes_need_the_group_key(group) -> None:
    for url in (group["prefill"], group["decode"]):
        assert httpx.get(f"{url}/internal/state", timeout=5).status_code == 401
        r = httpx.post(f"{url}/internal/flush_cache", headers={"X-Splitserve-Key": "wrong"}, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_key", r.text
        assert engine_state(url)["requests"] == 0  # with the key
    assert httpx.get(f"{group['unified']}/internal/state", timeout=5).status_code == 200  # no key: a dev engine
