"""The HTTP API fuzzed against a real engine process: thousands of malformed bodies, wrong types,
huge values, unicode and bad headers. Nothing may crash: no 5xx but a clear 503, the engine loop
alive, a good request served afterwards and every KV page back."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import assert_kv_back_to_start, served

pytestmark = pytest.mark.slow

EXAMPLES = 1300  # about 1 in 6 is valid after all: at least 1,000 bad ones
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logit_bias", "logprobs",
          "top_logprobs", "echo", "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty",
          "return_token_ids", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_signature"]
HUGE = st.sampled_from([2**31, 2**63, -2**63, 2**64 + 1, 10**30, 1e308, -1e308, 1e-320, float("inf"),
                        float("-inf"), float("nan")])
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | HUGE | st.floats(allow_nan=True)
           | st.text(max_size=40))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=12)


NUMBER = st.integers(-10, 10) | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | HUGE
NUMERIC = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
           "top_logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "bootstrap_port",
           "bootstrap_room"}


def field_value(name: str) -> st.SearchStrategy:
    """Values near what a field takes (to get past the first check) and anything at all."""
    if name in NUMERIC:
        return NUMBER | NUMBER | JSON
    near = {
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=8)
                  | st.lists(st.lists(st.integers(-5, 400), max_size=4), max_size=3),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                    "content": JSON}), max_size=3),
        "logit_bias": st.dictionaries(st.text(max_size=6) | st.integers(-5, 400).map(str), JSON, max_size=4),
        "stop": st.lists(st.text(max_size=5), max_size=20) | st.text(max_size=5),
    }.get(name)
    return near | JSON if near is not None else JSON


@st.composite
def bad_body(draw) -> tuple[str, bytes, dict[str, str]]:
    """(path, raw body, extra headers): a mostly sane body with some fields replaced by garbage."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body: dict = {"model": "m", "max_tokens": 2}
    body.update({"prompt": [1, 2, 3]} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=draw(st.sampled_from([1, 1, 2, 4])),
                              unique=True)):
        body[name] = draw(field_value(name))
    if draw(st.booleans()):
        body[draw(st.text(max_size=12))] = draw(JSON)
    kind = draw(st.sampled_from(["json", "json", "json", "raw", "other-json"]))
    if kind == "json":
        raw = json.dumps(body, allow_nan=True).encode()
    elif kind == "other-json":
        raw = json.dumps(draw(JSON), allow_nan=True).encode()
    else:
        raw = draw(st.binary(max_size=200))
    headers = draw(st.dictionaries(st.sampled_from(["content-type", "accept", "x-request-id", "x-splitserve-key",
                                                    "transfer-encoding-x", "user-agent"]),
                                   st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
                                   max_size=3))
    return path, raw, headers


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> str:
    with served(["--model", "tiny", "--served-model-name", "m", "--device", "cpu", "--context-length", "24",
                 "--max-total-tokens", "512", "--page-size", "4", "--max-running-requests", "4"],
                tmp_path_factory.mktemp("fuzz") / "engine.log") as url:
        yield url


def good_request_succeeds(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_thousands_of_malformed_requests_crash_nothing(engine: str) -> None:
    seen = {"bad": 0, "ok": 0}
    with httpx.Client(base_url=engine, timeout=60) as client:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(bad_body())
        def one(case: tuple[str, bytes, dict[str, str]]) -> None:
            path, raw, headers = case
            r = client.post(path, content=raw, headers=headers)
            assert r.status_code < 500, f"{r.status_code} for {raw[:300]!r} {headers}: {r.text[:500]}"
            if r.status_code >= 400:
                error = r.json()["error"]
                assert isinstance(error["message"], str) and error["message"], r.text
                seen["bad"] += 1
            else:
                seen["ok"] += 1

        one()
    assert seen["bad"] >= 1000, seen
    assert httpx.get(f"{engine}/health", timeout=5).status_code == 200
    good_request_succeeds(engine)
    assert_kv_back_to_start(engine)
