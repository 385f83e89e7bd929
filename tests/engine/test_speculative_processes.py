"""Speculative decoding as processes: `splitserve serve --role drafter` killed with SIGKILL while a
verifier streams through it, then restarted on the same port and joined again; `splitserve up
--drafter N` with prefill/decode. On the CPU by default; SPLITSERVE_TEST_DEVICE=cuda runs the same on a GPU, where
every server runs its engine core in a process of its own (the GPU default), in float32: there the projections and
attention take the row-invariant kernels at every row count, so a verifier's rows have plain decoding's bits
whatever its batch, as on the CPU (in bfloat16 only the verifier's own plain decoding is promised: a plain engine
of default settings takes cuBLAS past 16 rows, other bits, another greedy path; test_speculative_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import (
    REPO,
    TEST_CONTROL_KEY,
    ServerProcess,
    assert_kv_back_to_start,
    free_port,
    splitserve_env,
    wait_http_ok,
)

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams

KEY = {"SPLITSERVE_TRANSFER_CONTROL_KEY": TEST_CONTROL_KEY}  # also opens /internal/* for the leak checks
DEVICE = os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu")
DTYPE = "float32"
# A GPU streams 120 tokens of the tiny model in well under the second a lost drafter takes to notice: its
# streams are long enough that the SIGKILL lands mid-stream there too.
MAX_TOKENS = 120 if DEVICE == "cpu" else 1500
MAX_TOTAL_TOKENS = 4096 if DEVICE == "cpu" else 8192
ENGINE_ARGS = ["--model", "tiny", "--device", DEVICE, "--dtype", DTYPE, "--page-size", "4",
               "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43, 44, 45], [100, 7, 100], [3, 3, 3, 3]]

pytestmark = pytest.mark.slow

# How long a verifier step waits for its drafts. These tests check that drafts flow and outputs stay exact, not
# how fast: four engine processes share CI's two cores there, where a drafter's K steps can take longer than a
# 30 ms wait, and a draft that always arrives after its step is stale (a run verified 3 drafted tokens of 60).
# The wait ends as soon as the drafts are in.
DRAFT_WAIT_MS = "500"


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    found = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def drafter_state(verifier_url: str) -> str:
    drafters = httpx.get(f"{verifier_url}/health", timeout=5).json()["drafters"]
    (state,) = [d["state"] for d in drafters.values()]
    return state


SPEC_METRICS = ("splitserve_spec_draft_tokens_total", "splitserve_spec_accepted_tokens_total",
                "splitserve_spec_fallbacks_total")


def spec_state(verifier_url: str, drafter_url: str) -> dict:
    """What to look at when drafts are not in use: the verifier's counters and both sides' view of the mesh."""
    verifier = httpx.get(f"{verifier_url}/health", timeout=5).json()
    drafter = httpx.get(f"{drafter_url}/health", timeout=5).json()
    return {**{n: metric(verifier_url, n) for n in SPEC_METRICS},
            "verifier": {k: verifier.get(k) for k in ("drafters", "joined_drafters", "speculating", "synced",
                                                      "quarantined")},
            "drafter": {k: drafter.get(k) for k in ("leases", "draft_requests", "synced", "drafted", "held_commits",
                                                    "held_kept", "dropped_messages", "stale_dropped", "quarantined")}}


def wait_for(check, timeout: float, what: str, state=None) -> float:
    """Seconds until `check()` holds; fails after `timeout` with `state()` (what to look at) if given."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s" + (
            f": {state()}" if state is not None else "")
        time.sleep(0.02)
    return time.monotonic() - start


def complete(url: str, prompt: list[int], out: dict[int, list[int]], index: int) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids") or []
                assert choice.get("finish_reason") in (None, "length"), choice
    out[index] = tokens


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    engine = Engine(EngineConfig(model="tiny", device=DEVICE, dtype=DTYPE, page_size=4,
                                 max_total_tokens=MAX_TOTAL_TOKENS))
    engine.start()
    try:
        return generate_tokens(engine, PROMPTS, SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True))
    finally:
        engine.stop()


def test_a_killed_drafter_loses_no_request_and_a_restarted_one_is_joined_again(tmp_path: Path, plain) -> None:
    mesh_port, drafter_port, verifier_port = free_port(), free_port(), free_port()
    drafter_args = ["serve", "--role", "drafter", *ENGINE_ARGS, "--port", str(drafter_port),
                    "--draft-mesh-port", str(mesh_port)]
    verifier_url, drafter_url = f"http://127.0.0.1:{verifier_port}", f"http://127.0.0.1:{drafter_port}"
    procs = [ServerProcess(drafter_args, tmp_path / "drafter-1.log", KEY),
             ServerProcess(["serve", "--role", "unified", *ENGINE_ARGS, "--served-model-name", "m",
                            "--port", str(verifier_port), "--drafter", f"127.0.0.1:{mesh_port}",
                            "--num-draft-tokens", "4", "--draft-wait-ms", DRAFT_WAIT_MS,
                            "--no-speculation-gate"], tmp_path / "verifier.log", KEY)]
    try:
        wait_http_ok(f"{drafter_url}/health", procs[0].proc, 120, procs[0].log)
        wait_http_ok(f"{verifier_url}/health", procs[1].proc, 120, procs[1].log)
        wait_for(lambda: drafter_state(verifier_url) == "joined", 10, "join")
        wrong = httpx.post(f"{drafter_url}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=30)
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "not_served_by_role"
        assert "drafter engine serves the draft mesh of its verifiers" in wrong.json()["error"]["message"]

        outs: dict[int, list[int]] = {}
        threads = [threading.Thread(target=complete, args=(verifier_url, p, outs, i)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        wait_for(lambda: metric(verifier_url, "splitserve_spec_accepted_tokens_total") >= 20, 60,
                 "drafts in use", lambda: spec_state(verifier_url, drafter_url))
        procs[0].kill()  # SIGKILL, mid-stream
        fallback_s = wait_for(lambda: drafter_state(verifier_url) != "joined", 5, "fallback")
        assert fallback_s < 2.0
        assert any(t.is_alive() for t in threads), (
            f"every stream ended before the drafter was found lost ({fallback_s:.2f} s after the kill)")
        for t in threads:
            t.join(timeout=120)
        assert [outs[i] for i in range(len(PROMPTS))] == plain  # every request, token for token
        assert metric(verifier_url, "splitserve_spec_fallbacks_total") >= 1
        drafted_before = metric(verifier_url, "splitserve_spec_draft_tokens_total")
        assert_kv_back_to_start(verifier_url)

        procs[0] = ServerProcess(drafter_args, tmp_path / "drafter-2.log", KEY)  # the same ports again
        wait_http_ok(f"{drafter_url}/health", procs[0].proc, 120, procs[0].log)
        wait_for(lambda: drafter_state(verifier_url) == "joined", 10, "rejoin")
        again: dict[int, list[int]] = {}
        complete(verifier_url, PROMPTS[0], again, 0)
        assert again[0] == plain[0]
        drafted = metric(verifier_url, "splitserve_spec_draft_tokens_total") - drafted_before
        assert drafted >= 20 and httpx.get(f"{drafter_url}/health").json()["leases"] == 1
        assert_kv_back_to_start(verifier_url)
        assert_kv_back_to_start(drafter_url)
    finally:
        for p in reversed(procs):
            p.stop()


# Prefill -> decode goes over Mooncake whatever the device. CI installs it (scripts/install.sh --test), and so does the
# Dockerfile's image; the benchmark GPU machine's image, which runs this file on the CPU by default, does not.
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="prefill -> decode over Mooncake needs mooncake-transfer-engine")
def test_up_with_drafters_serves_prefill_decode_with_speculation(tmp_path: Path, plain) -> None:
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve", "up", "--port", str(port), "--device", DEVICE,
                             "--model", "tiny", "--prefill", "1", "--decode", "1", "--drafter", "1",
                             "--speculative-tokens", "3",
                             "--transfer-control-key", TEST_CONTROL_KEY,
                             "--engine-args", f"--draft-wait-ms {DRAFT_WAIT_MS} --page-size 4 --max-total-tokens 4096 "
                                             f"--dtype {DTYPE} --no-speculation-gate"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=splitserve_env(), cwd=REPO.parent)
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"endpoint: http://127.0.0.1:{port}/v1", (line, log.seek(0) or log.read()[-3000:])
        log.seek(0)
        decode_port = re.search(r"starting decode-0: serve --role decode .*?--port (\d+)", log.read()).group(1)
        decode_url = f"http://127.0.0.1:{decode_port}"
        assert drafter_state(decode_url) == "joined"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == plain[1][:60]
        drafted = metric(decode_url, "splitserve_spec_draft_tokens_total")
        assert drafted >= 10 and metric(decode_url, "splitserve_spec_accepted_tokens_total") >= 0.9 * drafted
        assert_kv_back_to_start(decode_url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    finally:
        if proc.poll() is None:  # a failed assertion: `up` still stops what it started (its own session)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
