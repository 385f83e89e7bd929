"""`serve --engine-process`: the engine core in a process of its own, the API server in another,
over ZeroMQ IPC. Real processes and sockets: the outputs equal the in-process engine's token for
token, aborts and the bounded inbox work across the split, engine metrics reach /metrics, SIGTERM
leaves no process behind, and a core killed -9 fails its requests with an error that says so."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from engine_checkpoints import write
from servers import ServerProcess, assert_kv_back_to_start, engine_state, free_port, served, wait_http_ok

from splitserve.api.core_protocol import (
    FROM_CORE,
    ipc_address,
    output_from_wire,
    output_to_wire,
    params_from_wire,
    params_to_wire,
)
from splitserve.engine.grammar.spec import GrammarSpec
from splitserve.engine.request import FinishReason, TokenOutput
from splitserve.engine.sampling_params import SamplingParams

MODEL = "m"
ENGINE_ARGS = ["--served-model-name", MODEL, "--page-size", "4", "--chunked-prefill-size", "8",
               "--max-total-tokens", "2048", "--max-running-requests", "4", "--device", "cpu"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def split(checkpoint: Path, tmp_path_factory) -> str:
    # One running request, two waiting, an inbox of two (the in-process bounds of test_request_faults).
    with served(["--model", str(checkpoint), *ENGINE_ARGS, "--engine-process", "--max-running-requests", "1",
                 "--max-waiting-requests", "2", "--max-inbox", "2"],
                tmp_path_factory.mktemp("log") / "split.log") as url:
        yield url


def body(prompt: list[int], max_tokens: int = 6, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def post(url: str, payload: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=timeout)


def stream_tokens(url: str, payload: dict) -> tuple[list[int], list[dict]]:
    tokens, events = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**payload, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                events.append(event)
                if event.get("choices"):
                    tokens += event["choices"][0].get("token_ids", [])
    return tokens, events


def test_the_wire_format_round_trips_params_and_outputs() -> None:
    params = SamplingParams(max_new_tokens=7, temperature=0.5, logit_bias={5: -2.0}, seed=3, stop=["ab"],
                            logprobs=2, grammar=GrammarSpec("regex", "[a-z]+", "regex"))
    assert params_from_wire(params_to_wire(params)) == params
    out = TokenOutput("r", [4], "x", logprobs=[-0.5], top_logprobs=[[(4, -0.5), (9, -1.5)]],
                      finish_reason=FinishReason.STOP, prompt_tokens=3, completion_tokens=1, cached_tokens=2)
    import msgpack
    row = msgpack.unpackb(msgpack.packb(output_to_wire(out)), strict_map_key=False)
    assert output_from_wire(row) == out


def test_greedy_output_equals_the_in_process_engine_token_for_token(checkpoint: Path, split: str,
                                                                    tmp_path: Path) -> None:
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41]]
    with served(["--model", str(checkpoint), *ENGINE_ARGS], tmp_path / "one.log") as one:
        expected = [post(one, body(p, 12)).json()["choices"][0] for p in prompts]
        expected_text = post(one, body([5, 6], 12, stop=["\n"], ignore_eos=False)).json()["choices"][0]
    got = [post(split, body(p, 12)).json()["choices"][0] for p in prompts]
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in expected]
    # No stop strings: the API server made the text from the token ids, the same text.
    assert [c["text"] for c in got] == [c["text"] for c in expected]
    streamed, events = stream_tokens(split, body(prompts[1], 12))
    assert streamed == expected[1]["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == expected[1]["text"]
    text = post(split, body([5, 6], 12, stop=["\n"], ignore_eos=False)).json()["choices"][0]
    assert (text["text"], text["finish_reason"]) == (expected_text["text"], expected_text["finish_reason"])
    assert_kv_back_to_start(split)


def test_structured_output_and_bad_grammar_cross_the_split(split: str) -> None:
    r = post(split, body([1, 2], 6, regex="[ab]{3}", ignore_eos=False, temperature=1.0, seed=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in {a + b + c for a in "ab" for b in "ab" for c in "ab"}
    r = post(split, body([1, 2], 6, regex="[ab", ignore_eos=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text


def test_engine_metrics_reach_the_api_servers_metrics(split: str) -> None:
    def generated() -> float:
        text = httpx.get(f"{split}/metrics", timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("splitserve_generation_tokens_total"))
    before = generated()
    assert post(split, body([3, 4], 5)).status_code == 200
    assert generated() == before + 5


def test_client_disconnect_mid_stream_aborts_in_the_core(split: str) -> None:
    with httpx.stream("POST", f"{split}/v1/completions", json={**body([1, 2], 1000), "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if '"token_ids":[' in line and '"token_ids":[]' not in line:
                break  # tokens flow: leave
    assert_kv_back_to_start(split)


def test_a_full_inbox_answers_503_with_retry_after(split: str) -> None:
    # A long request holds the one running slot for the whole burst, so none of the burst can run.
    held = [threading.Thread(target=post, args=(split, body([9, 2, 3], 1000), 120), daemon=True)]
    for t in held:
        t.start()
    deadline = time.monotonic() + 30
    while engine_state(split, key="")["running"] < 1:
        assert time.monotonic() < deadline, "the long requests never started"
        time.sleep(0.01)
    results: list[httpx.Response] = []
    burst = [threading.Thread(target=lambda i=i: results.append(post(split, body([i + 1, 5], 2), 120)))
             for i in range(9)]
    for t in burst:
        t.start()
    for t in [*burst, *held]:
        t.join(120)
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503} and codes.count(503) >= 5, codes  # at most 2 waiting + 2 in the inbox taken
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded", r.text
    assert post(split, body([1, 2], 2)).status_code == 200
    assert_kv_back_to_start(split, key="")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def split_server(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[str, ServerProcess]]:
    """A server with its engine core process, ready; its URL and process (the tests signal and kill it)."""
    port = free_port()
    proc = ServerProcess(["serve", "--model", str(checkpoint), *ENGINE_ARGS, "--engine-process", "--port", str(port)],
                         tmp_path / "server.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc.proc, 120, proc.log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


def test_sigterm_stops_the_server_and_its_core(checkpoint: Path, tmp_path: Path) -> None:
    with split_server(checkpoint, tmp_path) as (url, proc):
        core = engine_state(url, key="")["engine_core_pid"]
        assert alive(core)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while alive(core):
            assert time.monotonic() < deadline, f"the engine core {core} outlived its server"
            time.sleep(0.05)


def test_a_server_killed_takes_its_core_with_it(checkpoint: Path, tmp_path: Path) -> None:
    with split_server(checkpoint, tmp_path) as (url, proc):
        state = engine_state(url, key="")
        core, folder = state["engine_core_pid"], Path(state["engine_core_ipc_dir"])
        assert folder.is_dir()
        proc.kill()  # SIGKILL: no shutdown code runs in the server
        deadline = time.monotonic() + 30
        while alive(core):
            assert time.monotonic() < deadline, f"the engine core {core} outlived its killed server"
            time.sleep(0.05)
        assert not folder.exists()  # the core took its sockets' folder with it


def stream_errors_after(url: str, interrupt: Callable[[], object]) -> tuple[list[str], list[str]]:
    """Streams a long completion, calls `interrupt()` once its first token has arrived, and returns
    the error messages among the lines after it, and those lines: the stream must end within 5 s."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body([1, 2], 1000), "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"token_ids":[' in line and '"token_ids":[]' not in line:
                break
        interrupted = time.monotonic()
        interrupt()
        rest = list(lines)
    assert time.monotonic() - interrupted < 5
    return [json.loads(x[6:])["error"]["message"] for x in rest if x.startswith('data: {"error"')], rest

def test_a_core_killed_fails_its_requests_clearly_and_health_turns_503(checkpoint: Path, tmp_path: Path) -> None:
    with split_server(checkpoint, tmp_path) as (url, proc):
        core = engine_state(url, key="")["engine_core_pid"]
        waiting: dict = {}
        non_streamed = threading.Thread(target=lambda: waiting.update(r=post(url, body([4, 5], 1000), 60)))
        non_streamed.start()
        errors, rest = stream_errors_after(url, lambda: os.kill(core, signal.SIGKILL))
        assert errors and "engine core process" in errors[0] and "killed by signal 9" in errors[0], rest[-3:]
        non_streamed.join(30)
        assert waiting["r"].status_code == 503 and "engine core process" in waiting["r"].text, waiting["r"].text
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "killed by signal 9" in health.json()["status"], health.text
        later = post(url, body([1, 2], 2))
        assert later.status_code == 503 and "engine core process" in later.text, later.text
        # A router's poll of its page events gets the reason too (a 503, not a 500 and a traceback in the log).
        events = httpx.get(f"{url}/internal/kv_events?seq=0", timeout=5)
        assert events.status_code == 503 and events.json()["error"]["code"] == "engine_failed", events.text
        assert "killed by signal 9" in events.json()["error"]["message"]
        assert proc.proc.poll() is None  # the API server stays up to say so


def test_a_message_the_api_server_cannot_read_fails_its_requests_clearly(checkpoint: Path, tmp_path: Path) -> None:
    """A corrupt message on the core's output socket must not end the reader thread silently
    (every stream would then hang): the requests in flight end with the reason, /health turns 503,
    and the core that nothing reads any more is stopped."""
    with split_server(checkpoint, tmp_path) as (url, proc):
        state = engine_state(url, key="")
        core, folder = state["engine_core_pid"], state["engine_core_ipc_dir"]
        context = zmq.Context()
        intruder = context.socket(zmq.PUSH)
        intruder.setsockopt(zmq.LINGER, 1000)
        intruder.connect(ipc_address(folder, FROM_CORE))
        try:
            errors, rest = stream_errors_after(url, lambda: intruder.send(b"\xc1 not msgpack"))  # 0xc1: never msgpack
        finally:
            context.destroy(linger=0)
        assert errors and "could not read the engine core" in errors[0], rest[-3:]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "could not read the engine core" in health.json()["status"], health.text
        later = post(url, body([1, 2], 2))
        assert later.status_code == 503 and "could not read the engine core" in later.text, later.text
        deadline = time.monotonic() + 30
        while alive(core):
            assert time.monotonic() < deadline, f"the engine core {core} still runs with nothing reading it"
            time.sleep(0.05)
        assert proc.proc.poll() is None  # the API server stays up to say so
