"""Encoder disaggregation end to end: 1 encode + 1 prefill + 1 decode, and 2 encode + 1 prefill +
1 decode, behind the router, equal the unified engine token for token; bad images are 400s before
prefill work; text skips the encoders; a dead encoder is retried around, or fails its request
cleanly; an encoder killed -9 mid-write is retried around, and its prefill tells the waiting decode
at once (abort_room); rows that never come give 408; every engine's slots, rooms and pages return to
their start.

Mid-write, deterministically: the `encode-slow-*` engines run with `SPLITSERVE_EMBEDDING_WRITE_PAUSE_S`, a
test-only flag that writes each item's rows in two halves with a pause between; the tests wait
until the encoder's health says an item is partly written (half its bytes are in the prefill's
slot), then kill it."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import secrets
import signal
import threading
import time

import httpx
import pytest
from server_group import (
    ServerGroup,
    answer_across_a_kill_mid_write,
    chat_all,
    image,
    kill_mid_write,
    png_bytes,
    png_url,
)
from servers import (
    TEST_CONTROL_KEY,
    assert_kv_back_to_start,
    bootstrap_grant,
    engine_state,
    free_port,
)

from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.engine.multimodal.image_items import image_digest
from splitserve.router.backend_pool import Backend
from splitserve.router.image_encoding import encoder_ring
from splitserve.transfer.bootstrap_grant import KEY_HEADER

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "2048",
          "--max-running-requests", "8"]
TRANSFER = ["--transfer-heartbeat-interval-s", "0.3", "--transfer-heartbeat-misses", "4",
            "--transfer-control-key", TEST_CONTROL_KEY]
HEARTBEAT_TIMEOUT_S = 0.3 * 4
WRITE_PAUSE_S = 20.0  # far longer than any bound asserted below: the kill always lands in the pause


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epd")
    d = ServerGroup(tmp, write_llava_checkpoint(tmp / "ckpt", seed=7), ENGINE)
    d.engine("unified", "unified", "--chunked-prefill-size", "8")
    for name in ("encode-a", "encode-b", "encode-c"):
        d.engine(name, "encode", *TRANSFER)
    for name in ("encode-slow-1", "encode-slow-2", "encode-slow-3", "encode-slow-4"):
        d.engine(name, "encode", *TRANSFER, env={"SPLITSERVE_EMBEDDING_WRITE_PAUSE_S": str(WRITE_PAUSE_S)})
    bootstrap = free_port()
    d.engine("prefill", "prefill", "--bootstrap-port", str(bootstrap), "--chunked-prefill-size", "8",
             "--embedding-timeout-s", "3", *TRANSFER)
    d.bootstrap_port = bootstrap
    d.engine("decode", "decode", *TRANSFER)
    pd = ["--prefill", d.url("prefill"), "--decode", d.url("decode"), "--health-interval-s", "0.3",
          "--transfer-control-key", TEST_CONTROL_KEY]
    d.start("router-1e", ["router", *pd, "--encode", d.url("encode-a")])
    d.start("router-2e", ["router", *pd, "--encode", d.url("encode-a"), d.url("encode-b")])
    d.start("router-failover", ["router", *pd, "--encode", d.url("encode-b"), d.url("encode-c")])
    d.start("router-midwrite", ["router", *pd, "--encode", d.url("encode-slow-1"), d.url("encode-b")])
    # The only encoder dies or freezes, and does not come back: a request waits --backend-wait-s for one, then 503.
    d.start("router-lone-encoder", ["router", *pd, "--encode", d.url("encode-slow-3"), "--backend-wait-s", "1"])
    d.start("router-frozen-encoder", ["router", *pd, "--encode", d.url("encode-slow-4"), "--backend-wait-s", "1"])
    try:
        d.wait()
        yield d
    finally:
        d.stop()


def body(parts: list[dict], max_tokens: int = 10) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def assert_everything_back(d: ServerGroup, timeout: float = 10.0) -> None:
    assert_kv_back_to_start(d.url("prefill"))
    assert_kv_back_to_start(d.url("decode"))
    deadline = time.monotonic() + timeout
    while True:
        pre = health(d.url("prefill"))["embedding"]
        alive = [n for n in ("encode-a", "encode-b") if d.procs[n][1].proc.poll() is None]
        encoders = [health(d.url(n))["embedding"] for n in alive]
        clean = (pre["waiting"] == 0 and pre["staged"] == 0 and pre["rooms"] == 0 and pre["leased"] == 0
                 and pre["fenced"] == 0 and all(e["pinned_slots"] == 0 and e["rooms"] == 0 and e["queued"] == 0
                                             for e in encoders))
        if clean:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"embedding resources not back: prefill {pre}, encoders {encoders}")
        time.sleep(0.1)


CASES = [
    [{"type": "text", "text": "plain text, no encoder"}],
    [image(png_url(40, 30, 1)), {"type": "text", "text": "describe"}],
    [image(png_url(25, 60, 2, "JPEG")), {"type": "text", "text": "describe"}],
    [{"type": "text", "text": "two"}, image(png_url(90, 70, 3)), image(png_url(33, 33, 4, "WEBP"))],
    [image(png_url(40, 30, 1)), {"type": "text", "text": "the first image again"}],
    [image(png_url(61, 47, 5)), image(png_url(61, 47, 5)), {"type": "text", "text": "twice the same"}],
]


@pytest.mark.parametrize("router", ["router-1e", "router-2e"])
def test_epd_equals_unified_token_for_token(deployment: ServerGroup, router: str) -> None:
    bodies = [body(c) for c in CASES]
    want = [r.json()["choices"][0] for r in chat_all(deployment.url("unified"), bodies)]
    got = chat_all(deployment.url(router), bodies)
    for case, w, g in zip(CASES, want, got, strict=True):
        assert g.status_code == 200, g.text
        choice = g.json()["choices"][0]
        assert choice["token_ids"] == w["token_ids"], case
        assert choice["prompt_token_ids"] == w["prompt_token_ids"]
    assert_everything_back(deployment)
    a = health(deployment.url("encode-a"))["embedding"]["cached_images"]
    b = health(deployment.url("encode-b"))["embedding"]["cached_images"]
    if router == "router-1e":
        assert a == 5  # every distinct image, once (repeats were cache hits)
    else:
        assert b > 0  # the second encoder took its share by image hash


def test_text_only_requests_skip_the_encoders(deployment: ServerGroup) -> None:
    before = httpx.get(f"{deployment.url('encode-a')}/metrics").text.count("splitserve_embedding_items_total{")
    r = httpx.post(f"{deployment.url('router-1e')}/v1/chat/completions", json=body([{"type": "text", "text": "hi"}]),
                   timeout=60)
    assert r.status_code == 200
    after = httpx.get(f"{deployment.url('encode-a')}/metrics").text.count("splitserve_embedding_items_total{")
    assert after == before


def test_only_the_group_may_hand_an_encoder_work(deployment: ServerGroup) -> None:
    items = {"items": [{"room": secrets.randbits(63), "image_url": {"url": png_url(20, 20, 5)}}]}
    for headers in ({}, {KEY_HEADER: "not-the-key"}):
        r = httpx.post(f"{deployment.url('encode-a')}/v1/encode", json=items, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    assert health(deployment.url("encode-a"))["embedding"]["queued"] == 0  # nothing was taken


def test_an_encoder_sends_text_generation_elsewhere_with_a_404(deployment: ServerGroup) -> None:
    """A completion sent straight to an encoder is the client's mistake: a 404 that says where text goes, not a
    503 that invites a retry, and no engine work."""
    url = deployment.url("encode-a")
    for path, payload in (("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
                          ("/v1/chat/completions", body([{"type": "text", "text": "hi"}]))):
        r = httpx.post(f"{url}{path}", json=payload, timeout=30)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "not_served_by_role"
        assert error["message"].startswith("this encode engine serves /v1/encode, called by the router, not "
                                           "completions; send text generation to the router")
    assert health(url)["embedding"]["queued"] == 0


def encode_call(d: ServerGroup, encoder: str, rooms: list[int]) -> httpx.Response:
    items = [{"room": room, "image_url": {"url": png_url(20, 20 + i, 40 + i)}} for i, room in enumerate(rooms)]
    return httpx.post(f"{d.url(encoder)}/v1/encode", json={"items": items}, headers={KEY_HEADER: TEST_CONTROL_KEY},
                      timeout=30)


def failed_items(d: ServerGroup, encoder: str) -> float:
    line = 'splitserve_embedding_items_total{side="encoder",outcome="failed"} '
    found = [x for x in httpx.get(f"{d.url(encoder)}/metrics", timeout=5).text.splitlines() if x.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


def test_a_call_with_a_taken_room_opens_none_of_its_rooms(deployment: ServerGroup) -> None:
    """All or nothing: a 409 for the second item leaves the first item's room closed (not open until
    the bootstrap timeout, 60 s here) and counts no failed item; the taken room still serves its request."""
    start, failed = health(deployment.url("encode-a"))["embedding"], failed_items(deployment, "encode-a")
    taken, fresh = secrets.randbits(63), secrets.randbits(63)
    first = encode_call(deployment, "encode-a", [taken])
    assert first.status_code == 200, first.text
    for rooms in ([fresh, taken], [fresh, fresh]):  # taken by an earlier call, or twice in this one
        r = encode_call(deployment, "encode-a", rooms)
        assert r.status_code == 409 and f"room {rooms[1]} is already open" in r.text, r.text
        now = health(deployment.url("encode-a"))["embedding"]
        assert now["rooms"] == start["rooms"] + 1 and now["early"] == start["early"], (start, now)  # `taken` only
        assert failed_items(deployment, "encode-a") == failed  # a refused call is no failed item
    # The open room's request is served as the router would send it, and then everything is back.
    ref = {"type": "image_ref", "image_ref": {"digest": first.json()["items"][0]["digest"],
                                              "encoder_addr": first.json()["endpoint"], "room": taken}}
    pre, dec = prefill_and_decode(deployment, [ref, {"type": "text", "text": "x"}])
    assert pre.status_code == 200 and dec.status_code == 200, (pre.text, dec.text)
    assert_everything_back(deployment)


def test_bad_images_are_400s_before_any_prefill_work(deployment: ServerGroup) -> None:
    steps = engine_state(deployment.url('prefill'))["steps"]
    bad = [("data:image/png;base64,@@@", "invalid_image"), ("data:image/gif;base64,R0lGODlh", "unsupported_image_type"),
           ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "invalid_image"),
           ("ftp://example/x.png", "unsupported_image_url")]
    for url, code in bad:
        parts = [image(png_url(20, 20, 9)), {"type": "text", "text": "x"}, image(url)]
        r = httpx.post(f"{deployment.url('router-2e')}/v1/chat/completions", json=body(parts), timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[0].content[2]" and r.json()["error"]["code"] == code
    assert engine_state(deployment.url('prefill'))["steps"] == steps
    assert_everything_back(deployment)


def prefill_and_decode(d: ServerGroup, parts: list[dict]) -> tuple[httpx.Response, httpx.Response]:
    """One request sent to the prefill and the decode directly, as the router would (no encoder call)."""
    pd = {**body(parts), **bootstrap_grant("127.0.0.1", d.bootstrap_port, secrets.randbits(63))}

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(client.post(f"{d.url('prefill')}/v1/chat/completions", json=pd),
                                        client.post(f"{d.url('decode')}/v1/chat/completions", json=pd))
    pre, dec = asyncio.run(both())
    return pre, dec


def image_ref(encoder: str) -> dict:
    return {"type": "image_ref", "image_ref": {"digest": "ab" * 32, "encoder_addr": encoder,
                                               "room": secrets.randbits(63)}}


def test_rows_that_never_come_give_408_and_free_everything(deployment: ServerGroup) -> None:
    """A room the encoder never got: prefill times out (408) and its decode is told at once."""
    encoder = health(deployment.url("encode-a"))["embedding_endpoint"]
    started = time.monotonic()
    pre, dec = prefill_and_decode(deployment, [image_ref(encoder), {"type": "text", "text": "x"}])
    assert pre.status_code == 408 and pre.json()["error"]["code"] == "timeout", pre.text
    assert dec.status_code == 503, dec.text
    assert time.monotonic() - started < 6
    assert_everything_back(deployment)


def test_a_killed_encoder_is_retried_around_or_fails_cleanly(deployment: ServerGroup) -> None:
    cases = [body([image(png_url(30 + i, 20, 100 + i)), {"type": "text", "text": f"img {i}"}]) for i in range(4)]
    want = [r.json()["choices"][0]["token_ids"] for r in chat_all(deployment.url("unified"), cases)]
    _, victim = deployment.procs["encode-c"]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    got = chat_all(deployment.url("router-failover"), cases)  # encode-b takes the images meant for encode-c
    assert [g.status_code for g in got] == [200] * 4, [g.text for g in got]
    assert [g.json()["choices"][0]["token_ids"] for g in got] == want
    # A prefill told to wait for rows from a dead encoder fails within the heartbeat bound, and so
    # does its decode (abort_room), with nothing left behind.
    started = time.monotonic()
    pre, dec = prefill_and_decode(deployment, [image_ref(f"tcp://127.0.0.1:{free_port()}"),
                                               {"type": "text", "text": "x"}])
    assert pre.status_code == 503 and "stopped answering" in pre.json()["error"]["message"], pre.text
    assert dec.status_code == 503
    assert time.monotonic() - started < 3
    assert_everything_back(deployment)


def router_retries(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve_router_retries_total"))


def finished(url: str, reason: str) -> float:
    """An engine's count of requests finished for `reason` (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("splitserve_requests_finished_total") and f'reason="{reason}"' in line)


def embedding_slots_free(d: ServerGroup) -> int:
    return health(d.url("prefill"))["embedding"]["free"]


def test_an_encoder_killed_mid_write_is_retried_on_another_encoder(deployment: ServerGroup) -> None:
    """The router watches the encoders of an attempt: the one killed mid-write is ejected, the
    attempt dropped (prefill and decode free its room) and the retry encodes on the other encoder."""
    slow, other = deployment.url("encode-slow-1"), deployment.url("encode-b")
    ring = [Backend(slow, "encode"), Backend(other, "encode")]
    seed = next(s for s in range(200, 300)
                if encoder_ring(ring, image_digest(png_bytes(36, 28, s)))[0].url == slow)  # slow-1 takes it first
    case = body([image(png_url(36, 28, seed)), {"type": "text", "text": "killed mid-write"}])
    want = chat_all(deployment.url("unified"), [case])[0].json()["choices"][0]["token_ids"]
    free_at_start = embedding_slots_free(deployment)
    retries_before = router_retries(deployment.url("router-midwrite"))
    prefill_errors, prefill_aborts = finished(deployment.url("prefill"), "error"), finished(deployment.url("prefill"),
                                                                                             "abort")
    r, answered_at, killed_at = answer_across_a_kill_mid_write(deployment, "router-midwrite", case, "encode-slow-1")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    log.info("killed mid-write: the retried answer came %.2f s after the kill", answered_at - killed_at)
    assert answered_at - killed_at < 10, "the retry waited for something other than the router seeing the kill"
    assert router_retries(deployment.url("router-midwrite")) == retries_before + 1
    # The router dropped the first attempt when it saw the encoder gone (the prefill's request was
    # aborted), not when the prefill's heartbeats noticed (that would have been an error).
    assert finished(deployment.url("prefill"), "abort") == prefill_aborts + 1
    assert finished(deployment.url("prefill"), "error") == prefill_errors
    assert_everything_back(deployment)
    assert embedding_slots_free(deployment) == free_at_start


def test_an_encoder_killed_mid_write_fails_its_prefill_and_tells_the_decode_at_once(deployment: ServerGroup) -> None:
    """No router: prefill's receiver sees the encoder die within the heartbeat bound, and the prefill
    aborts the KV room, so the decode (whose own transfer timeouts are 60 and 300 s) fails at once."""
    enc = deployment.url("encode-slow-2")
    room = secrets.randbits(63)
    r = httpx.post(f"{enc}/v1/encode", json={"items": [{"room": room, "image_url": {"url": png_url(44, 30, 77)}}]},
                   headers={KEY_HEADER: TEST_CONTROL_KEY}, timeout=30)
    assert r.status_code == 200, r.text
    ref = {"type": "image_ref", "image_ref": {"digest": r.json()["items"][0]["digest"],
                                              "encoder_addr": r.json()["endpoint"], "room": room}}
    pd = {**body([ref, {"type": "text", "text": "x"}]),
          **bootstrap_grant("127.0.0.1", deployment.bootstrap_port, secrets.randbits(63))}
    free_at_start = embedding_slots_free(deployment)
    answers: dict[str, tuple[httpx.Response, float]] = {}

    def post(role: str) -> None:
        answer = httpx.post(f"{deployment.url(role)}/v1/chat/completions", json=pd, timeout=120)
        answers[role] = (answer, time.monotonic())

    threads = [threading.Thread(target=post, args=(role,)) for role in ("prefill", "decode")]
    for t in threads:
        t.start()
    killed_at = kill_mid_write(deployment, "encode-slow-2")
    for t in threads:
        t.join(timeout=120)
    (pre, pre_at), (dec, dec_at) = answers["prefill"], answers["decode"]
    assert pre.status_code == 503 and "stopped answering" in pre.json()["error"]["message"], pre.text
    assert dec.status_code == 503, dec.text
    log.info("killed mid-write: prefill failed %.2f s and decode %.2f s after the kill (heartbeat bound %.1f s)",
             pre_at - killed_at, dec_at - killed_at, HEARTBEAT_TIMEOUT_S)
    # The prefill's heartbeat bound, then abort_room: far under the decode's own timeouts.
    assert pre_at - killed_at < HEARTBEAT_TIMEOUT_S + 1.5, pre_at - killed_at
    assert dec_at - killed_at < HEARTBEAT_TIMEOUT_S + 2.0, dec_at - killed_at
    assert_everything_back(deployment)
    assert embedding_slots_free(deployment) == free_at_start


def test_the_only_encoder_killed_mid_write_gives_a_clear_503_and_frees_everything(deployment: ServerGroup) -> None:
    case = body([image(png_url(52, 41, 88)), {"type": "text", "text": "nobody left to encode"}])
    free_at_start = embedding_slots_free(deployment)
    r, answered_at, killed_at = answer_across_a_kill_mid_write(deployment, "router-lone-encoder", case,
                                                               "encode-slow-3")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_encoder" and "no encoder could take the images" in r.text, r.text
    assert "waited 1 s for one (--backend-wait-s)" in r.text, r.text
    assert r.headers["retry-after"]
    log.info("the only encoder killed mid-write: 503 %.2f s after the kill", answered_at - killed_at)
    assert answered_at - killed_at < 10
    assert_everything_back(deployment)
    assert embedding_slots_free(deployment) == free_at_start


def test_a_frozen_encoder_s_slot_stays_fenced_while_others_equal_unified_and_lifts_after_sigcont(
        deployment: ServerGroup) -> None:
    """An encoder SIGSTOPped halfway through an item's write, past the heartbeat timeout: the
    prefill fails the item, but its slot stays fenced while the encoder is frozen (a resumed write
    could land in it); other image requests meanwhile equal the unified engine; after SIGCONT the
    encoder answers the repeated abort and the slot is free again. The frozen request itself ends
    either with the unified engine's tokens (retried on the resumed encoder) or a clear error."""
    name = "encode-slow-4"
    url, frozen = deployment.procs[name]
    prefill = deployment.url("prefill")
    free_at_start = embedding_slots_free(deployment)
    case = body([image(png_url(47, 39, 99)), {"type": "text", "text": "frozen halfway"}])
    done: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: done.append(httpx.post(
        f"{deployment.url('router-frozen-encoder')}/v1/chat/completions", json=case, timeout=120)))
    sender.start()
    deadline = time.monotonic() + 60
    while health(url)["embedding"]["partly_written"] == 0:
        assert time.monotonic() < deadline, f"{name} never got an item partly written"
        time.sleep(0.02)
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        deadline = frozen_at + 10
        while health(prefill)["embedding"]["fenced"] == 0:  # the item failed on heartbeat loss
            assert time.monotonic() < deadline, health(prefill)["embedding"]
            time.sleep(0.05)
        others = [body(CASES[1]), body(CASES[3])]
        want = [w.json()["choices"][0]["token_ids"] for w in chat_all(deployment.url("unified"), others)]
        got = chat_all(deployment.url("router-1e"), others)
        assert [g.json()["choices"][0]["token_ids"] for g in got] == want
        time.sleep(max(0.0, frozen_at + 4 * 1.2 - time.monotonic()))  # 4 heartbeat timeouts frozen
        pre = health(prefill)["embedding"]
        assert pre["fenced"] == 1, f"the fence lifted while the encoder was frozen: {pre}"
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    deadline = resumed_at + 10
    while health(prefill)["embedding"]["fenced"] != 0:
        assert time.monotonic() < deadline, health(prefill)["embedding"]
        time.sleep(0.02)
    log.info("frozen encoder: its slot's fence lifted %.2f s after SIGCONT", time.monotonic() - resumed_at)
    sender.join(timeout=120)
    (r,) = done
    if r.status_code == 200:
        unified = httpx.post(f"{deployment.url('unified')}/v1/chat/completions", json=case, timeout=120)
        assert r.json()["choices"][0]["token_ids"] == unified.json()["choices"][0]["token_ids"]
    else:
        assert r.status_code in (503, 408) and r.json()["error"]["message"], r.text
    log.info("the frozen encoder's request: %d", r.status_code)
    assert_everything_back(deployment)
    assert embedding_slots_free(deployment) == free_at_start


def test_an_encoder_frozen_before_its_call_answers_is_ejected_and_the_request_ends(deployment: ServerGroup) -> None:
    """SIGSTOP keeps the encoder's socket open: without a bound the router's /v1/encode call would
    wait for its 600 s read timeout. The prober ejects the encoder (its /health probes time out)
    and that ends the call: the router's only encoder gone, a clear 503."""
    name = "encode-slow-4"
    url, frozen = deployment.procs[name]
    router = deployment.url("router-frozen-encoder")
    case = body([image(png_url(33, 45, 12)), {"type": "text", "text": "frozen before it answers"}])
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        r = httpx.post(f"{router}/v1/chat/completions", json=case, timeout=60)
        answered_at = time.monotonic()
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_encoder", r.text
        log.info("encoder frozen before answering: 503 %.2f s later", answered_at - frozen_at)
        assert answered_at - frozen_at < 10, "the call waited for something other than the encoder's ejection"
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30

    def healthy_at_router() -> bool:
        backends = httpx.get(f"{router}/health", timeout=5).json()["backends"]
        return next(b for b in backends if b["url"] == url)["healthy"]

    while not healthy_at_router():
        assert time.monotonic() < deadline, "the encoder never came back after SIGCONT"
        time.sleep(0.1)
    assert_everything_back(deployment)
