"""A /v1/encode call that fails after its rooms opened closes them at once, in both serving paths:
the core's answer came too late for the API server (`serve --engine-process`: 503), or the HTTP
client left before the answer (the one-process server and the split). Without that, the rooms
(and the slots their rows were encoded into) stay open until the bootstrap timeout, as no prefill
will ever ask for them. A call answered 200 keeps its rooms open for its prefill.

Late answers, deterministically: the encoders run with `SPLITSERVE_ENCODE_ANSWER_DELAY_S`, a test-only
flag that holds each call's answer back after its rooms opened (in the split, the core's main
thread waits before it replies); `late-split` also waits less than that for the core's answer
(`--encode-call-timeout-s`). Clients leave by their own read timeout, shorter than the delay.

Real processes: a one-process encoder and two split ones (API server + core), Mooncake TCP on
loopback; the counts are the encoders' /health embedding figures and /metrics."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_group import ServerGroup, png_url
from servers import TEST_CONTROL_KEY, engine_state

from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.transfer.bootstrap_grant import KEY_HEADER

pytestmark = pytest.mark.slow

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "512",
          "--max-running-requests", "4"]
BOOTSTRAP_TIMEOUT_S = 60.0  # what an unasked room would otherwise be held for
ANSWER_DELAY_S = 4.0
CALL_TIMEOUT_S = 1.5  # late-split's wait for its core: shorter than the delay, so its calls time out
CLIENT_TIMEOUT_S = 1.0  # a client that leaves before the delayed answer
BACK_WITHIN_S = 12.0  # from the call's start: the delay plus slack, far below the bootstrap timeout
ENCODER = ["--transfer-control-key", TEST_CONTROL_KEY, "--transfer-bootstrap-timeout-s", str(BOOTSTRAP_TIMEOUT_S)]
LATE_ANSWERS = {"SPLITSERVE_ENCODE_ANSWER_DELAY_S": str(ANSWER_DELAY_S)}  # a test hook: environment only


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encode-call-failures")
    g = ServerGroup(tmp, write_llava_checkpoint(tmp / "ckpt", seed=7), ENGINE)
    g.engine("one-process", "encode", *ENCODER, env=LATE_ANSWERS)
    g.engine("late-split", "encode", "--engine-process", "--encode-call-timeout-s", str(CALL_TIMEOUT_S), *ENCODER,
             env=LATE_ANSWERS)
    g.engine("slow-split", "encode", "--engine-process", *ENCODER, env=LATE_ANSWERS)
    try:
        g.wait()
        for name in ("late-split", "slow-split"):  # each really is an API server and a core
            assert engine_state(g.url(name))["engine_core_pid"] != g.pid(name)
        yield g
    finally:
        g.stop()


def embedding(url: str) -> dict:
    """The encoder's embedding figures (a split core busy with a delayed answer replies once it is done)."""
    r = httpx.get(f"{url}/health", timeout=ANSWER_DELAY_S + 10)
    assert r.status_code == 200, r.text
    return r.json()["embedding"]


def failed_items(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=ANSWER_DELAY_S + 10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (sample.name == "splitserve_embedding_items_total" and sample.labels.get("side") == "encoder"
                    and sample.labels.get("outcome") == "failed"):
                return sample.value
    return 0.0


def post_encode(url: str, rooms: list[int], seed: int, timeout: float) -> httpx.Response:
    items = [{"room": room, "image_url": {"url": png_url(24 + i, 20, seed + i)}} for i, room in enumerate(rooms)]
    with httpx.Client(timeout=timeout) as client:  # its own connection: a timeout closes it
        return client.post(f"{url}/v1/encode", json={"items": items}, headers={KEY_HEADER: TEST_CONTROL_KEY})


def assert_closed_promptly(url: str, start: dict, failed_before: float, items: int, started: float) -> None:
    """Every room of the failed call closed (concluded as failed, nothing pinned or queued) well
    before the bootstrap timeout would have closed it."""
    while True:
        now = embedding(url)
        closed = failed_items(url) - failed_before
        if (now["rooms"], now["pinned_slots"], now["queued"]) == (start["rooms"], start["pinned_slots"], 0) \
                and closed == items:
            return
        assert time.monotonic() - started < BACK_WITHIN_S, \
            f"the failed call's rooms are still held after {BACK_WITHIN_S} s: {now}, {closed} of {items} closed"
        time.sleep(0.2)


@pytest.mark.parametrize("name", ["one-process", "slow-split"])
def test_a_client_that_leaves_before_the_answer_has_its_rooms_closed(group: ServerGroup, name: str) -> None:
    url = group.url(name)
    start, failed_before = embedding(url), failed_items(url)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        post_encode(url, [101, 102], seed=10, timeout=CLIENT_TIMEOUT_S)
    assert_closed_promptly(url, start, failed_before, 2, started)


def test_a_core_answer_later_than_the_call_timeout_is_a_503_and_its_rooms_are_closed(group: ServerGroup) -> None:
    url = group.url("late-split")
    start, failed_before = embedding(url), failed_items(url)
    started = time.monotonic()
    r = post_encode(url, [201, 202, 203], seed=20, timeout=ANSWER_DELAY_S + 20)
    assert r.status_code == 503 and "does not answer" in r.json()["error"]["message"], r.text
    assert time.monotonic() - started < ANSWER_DELAY_S, "the API server waited for the late answer"
    assert_closed_promptly(url, start, failed_before, 3, started)


def test_a_refused_call_closes_no_other_call_s_room(group: ServerGroup) -> None:
    """A 409 (a room of it is another call's) is a failed call too: closing it leaves the other call's room open."""
    url = group.url("slow-split")
    start, failed_before = embedding(url), failed_items(url)
    ok = post_encode(url, [302], seed=31, timeout=ANSWER_DELAY_S + 20)
    assert ok.status_code == 200, ok.text
    refused = post_encode(url, [303, 302], seed=32, timeout=ANSWER_DELAY_S + 20)
    assert refused.status_code == 409 and "room 302 is already open" in refused.text, refused.text
    time.sleep(1.0)  # a close would have landed by now
    now = embedding(url)
    assert now["rooms"] == start["rooms"] + 1 and failed_items(url) == failed_before, now  # 302 only, still open


def test_a_call_answered_200_keeps_its_rooms_open_for_the_prefill(group: ServerGroup) -> None:
    url = group.url("one-process")
    start, failed_before = embedding(url), failed_items(url)
    r = post_encode(url, [401, 402], seed=40, timeout=ANSWER_DELAY_S + 20)
    assert r.status_code == 200 and [i["room"] for i in r.json()["items"]] == [401, 402], r.text
    time.sleep(1.0)  # a close would have landed by now
    now = embedding(url)
    assert now["rooms"] == start["rooms"] + 2 and failed_items(url) == failed_before, now
