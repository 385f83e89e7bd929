"""The router's HTTP surface in front of a real prefill+decode pair of tiny engines: its request
counter (a fanned-out n > 1 request counts once), its 404/405 answers, and its /health summary.
"""

from __future__ import annotations

import re

import httpx
import pytest
from servers import LocalDeployment, free_port

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.5", "--transfer-bootstrap-timeout-s", "60"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = LocalDeployment(tmp_path_factory.mktemp("router-app"), "tiny", ENGINE_ARGS, TRANSFER_ARGS)
    try:
        prefill, decode = d.engine("prefill"), d.engine("decode")
        d.wait([prefill, decode])
        router = d.router([prefill], [decode])
        d.wait([router], timeout=60)
        yield {"d": d, "prefill": prefill, "decode": decode, "router": router}
    finally:
        d.stop()


def counted(router: str) -> dict[str, float]:
    text = httpx.get(f"{router}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^splitserve_router_requests_total\{outcome="([a-z_]+)"\} (\S+)$', text, re.M)}


def test_a_fanned_out_request_counts_once_streamed_or_not(pair) -> None:
    router = pair["router"]
    body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True, "temperature": 0.7,
            "seed": 1}
    before = counted(router).get("ok", 0.0)
    r = httpx.post(f"{router}/v1/completions", json={**body, "n": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert counted(router).get("ok", 0.0) == before + 1
    with httpx.stream("POST", f"{router}/v1/completions", json={**body, "n": 2, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert counted(router).get("ok", 0.0) == before + 2
    r = httpx.post(f"{router}/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)  # two prompts
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)  # and a plain one
    assert r.status_code == 200
    assert counted(router).get("ok", 0.0) == before + 4


def test_unknown_paths_and_methods_are_openai_style_json_errors(pair) -> None:
    router = pair["router"]
    r = httpx.post(f"{router}/v1/nothing-here", json={}, timeout=5)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "Invalid URL (POST /v1/nothing-here): no such endpoint",
                                  "type": "invalid_request_error", "param": None, "code": "not_found"}}
    r = httpx.get(f"{router}/v1/completions", timeout=5)
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    error = r.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    # the same shape as the router's own errors
    assert set(httpx.post(f"{router}/v1/completions", content=b"{", timeout=5).json()["error"]) == set(error)


def test_health_counts_encoders_too(pair) -> None:
    d = pair["d"]
    dead_encoder = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = d.router([pair["prefill"]], [pair["decode"]], "--encode", dead_encoder)
    d.wait([router], timeout=60)
    try:
        health = httpx.get(f"{router}/health", timeout=5).json()
        assert health["summary"] == "1 healthy prefill, 1 healthy decode, 0 healthy encode"
        assert health["roles"] == {"prefill": {"healthy": 1, "total": 1}, "decode": {"healthy": 1, "total": 1},
                                   "encode": {"healthy": 0, "total": 1}}
        assert {b["role"] for b in health["backends"]} == {"prefill", "decode", "encode"}
        assert httpx.get(f"{router}/ready", timeout=5).status_code == 200  # text requests need no encoder
    finally:
        d.procs[router].stop()
    plain = httpx.get(f"{pair['router']}/health", timeout=5).json()
    assert plain["summary"] == "1 healthy prefill, 1 healthy decode" and "encode" not in plain["roles"]
