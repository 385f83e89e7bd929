"""A prefill frozen mid-transfer (SIGSTOP) past the heartbeat timeout, then resumed (SIGCONT):
the decode fails the request, keeps its pages fenced while the prefill is frozen, serves others
meanwhile with output identical to the unified engine's, and frees the pages once the resumed
prefill confirms it stopped writing; later requests reusing those pages are identical too. Past
the fenced-page bound, a new request from the frozen prefill fails at once with a clear error.

Real processes: two prefill engines (one to freeze), a decode engine with a small pool (freed
pages are handed out again at once), a unified reference; Mooncake TCP on loopback.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start, bootstrap_grant, engine_state

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "1024", "--max-running-requests", "4", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "10"]
LONG_PROMPT = [(7 * i) % 251 + 3 for i in range(400)]  # 50 prefill chunks of 8: still transferring when frozen

pytestmark = pytest.mark.slow


def body(prompt: list[int], max_tokens: int = 6, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def fenced_pages(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r'^splitserve_kv_pages_fenced\{[^}]*\} (\S+)$', text, re.M)
    assert match, "no splitserve_kv_pages_fenced gauge"
    return float(match.group(1))


def split_request(prefill: str, decode: str, info: dict, room: int, prompt: list[int]) -> httpx.Response:
    meet = bootstrap_grant(info["bootstrap_host"], info["bootstrap_port"], room)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=httpx.post(f"{prefill}/v1/completions",
                                                                      json=body(prompt, **meet), timeout=120)))
    thread.start()
    r = httpx.post(f"{decode}/v1/completions", json=body(prompt, **meet), timeout=120)
    thread.join(120)
    return r


def test_a_frozen_prefill_cannot_write_into_pages_the_decode_gave_to_other_requests(tmp_path) -> None:
    checkpoint = write("llama-gqa-llama3rope", tmp_path / "ckpt")
    d = LocalDeployment(tmp_path, checkpoint, ENGINE_ARGS, TRANSFER_ARGS)
    try:
        # 256 pages; the frozen room fences 100 of them, over the bound of 25.
        frozen, healthy = d.engine("prefill"), d.engine("prefill")
        decode = d.engine("decode", "--transfer-fence-max-fraction", "0.1")
        unified = d.engine("unified")
        d.wait([frozen, healthy, decode, unified])
        frozen_info = httpx.get(f"{frozen}/health", timeout=5).json()
        healthy_info = httpx.get(f"{healthy}/health", timeout=5).json()
        prompts = [[(11 * i + 5 * k) % 241 + 2 for i in range(60)] for k in range(3)]
        expected = [httpx.post(f"{unified}/v1/completions", json=body(p), timeout=120).json()["choices"][0]
                    ["token_ids"] for p in prompts]
        start = assert_kv_back_to_start(decode)

        meet = bootstrap_grant(frozen_info["bootstrap_host"], frozen_info["bootstrap_port"], 9001)
        victim: dict = {}
        threading.Thread(target=lambda: victim.update(r=httpx.post(
            f"{decode}/v1/completions", json=body(LONG_PROMPT, **meet), timeout=120)), daemon=True).start()
        threading.Thread(target=lambda: httpx.post(f"{frozen}/v1/completions", json=body(LONG_PROMPT, **meet),
                                                   timeout=120), daemon=True).start()
        deadline = time.monotonic() + 30
        while engine_state(frozen)["steps"] < 3:  # its prompt is being computed and sent chunk by chunk
            assert time.monotonic() < deadline, "the prefill never started the prompt"
            time.sleep(0.01)
        pid = d.procs[frozen].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while "r" not in victim:
                assert time.monotonic() < deadline, "the decode request did not fail while its prefill was frozen"
                time.sleep(0.05)
            assert victim["r"].status_code != 200 or victim["r"].json()["choices"][0]["finish_reason"] == "error", \
                victim["r"].text
            held = fenced_pages(decode)
            assert held > 0, "the failed room's pages were freed while its prefill was frozen"
            # Others are served meanwhile, from the free pages, token for token as the unified engine.
            for k in (0, 1):
                r = split_request(healthy, decode, healthy_info, 9100 + k, prompts[k])
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == expected[k]
            # Past the bound, the frozen prefill gets no new room here: a clear error at once.
            asked = time.monotonic()
            meet = bootstrap_grant(frozen_info["bootstrap_host"], frozen_info["bootstrap_port"], 9050)
            refused = httpx.post(f"{decode}/v1/completions", json=body(prompts[2], **meet), timeout=30)
            assert time.monotonic() - asked < 5
            assert "fenced" in refused.text, refused.text
            time.sleep(1.0)
            assert fenced_pages(decode) == held, "the fence lifted while the prefill was still frozen"
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        while fenced_pages(decode) > 0:
            assert time.monotonic() - resumed < 10, "the fence did not lift after the prefill resumed"
            time.sleep(0.05)
        print(f"{held:.0f} pages fenced, lifted {time.monotonic() - resumed:.2f}s after SIGCONT")
        # The freed pages are handed out first now: the next requests reuse them.
        for k in (2, 0):
            r = split_request(healthy, decode, healthy_info, 9200 + k, prompts[k])
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[k]
        r = split_request(frozen, decode, frozen_info, 9300, prompts[1])  # the resumed prefill serves again
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[1]
        back = assert_kv_back_to_start(decode)
        assert back["kv_capacity"] == start["kv_capacity"]
        assert_kv_back_to_start(frozen)
    finally:
        d.stop()
