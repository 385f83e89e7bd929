"""Tensor parallelism on CPU: 2 processes over gloo give the logits and the greedy output of 1,
and a dead rank fails the engine clearly instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import ServerProcess, assert_kv_back_to_start, engine_state, free_port, wait_http_ok

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Request
from splitserve.engine.runner.forward_batch import decode_batch
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.tp.parallel_state import TensorParallelSizeError, check_tp_size
from splitserve.engine.tp.supervisor import TensorParallelSupervisor

MODEL = "tp-llama"
PAGE_SIZE = 4
MAX_SLOTS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))  # 6 heads, 2 KV heads


def test_tp_size_that_does_not_split_the_kv_heads_is_refused_before_starting(checkpoint: Path) -> None:
    model_cfg = ModelConfig.from_folder(checkpoint)
    check_tp_size(model_cfg, 2)
    with pytest.raises(TensorParallelSizeError, match=r"--tp-size 3: the model's KV heads \(2\) is not divisible"):
        check_tp_size(model_cfg, 3)
    with pytest.raises(TensorParallelSizeError, match=r"attention heads \(6\) is not divisible by 4"):
        check_tp_size(model_cfg, 4)


# ---- logits: rank 0 in this process, rank 1 a worker process ------------------------------------


def tp_config(checkpoint: Path, tp_size: int) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", page_size=PAGE_SIZE,
                        max_total_tokens=256, max_running_requests=MAX_SLOTS, tp_size=tp_size,
                        tp_timeout=60, tp_startup_timeout=120)


def request_in_slot(slot: int, prompt: list[int], page_table: torch.Tensor) -> Request:
    req = Request(request_id=f"r{slot}", prompt_ids=list(prompt), params=SamplingParams(), on_output=lambda _o: None)
    req.slot = slot
    pages_per_request = page_table.shape[1]
    # Disjoint pages per slot, interleaved across slots so that page numbers are not contiguous.
    page_table[slot] = torch.arange(pages_per_request, dtype=torch.int32) * MAX_SLOTS + slot + 1
    return req


@pytest.mark.slow
@torch.inference_mode()
def test_tp2_logits_equal_tp1_over_prefill_chunks_and_decode_steps(checkpoint: Path) -> None:
    model_cfg = ModelConfig.from_folder(checkpoint)
    single = ModelRunner(tp_config(checkpoint, 1), checkpoint, model_cfg)
    supervisor = TensorParallelSupervisor(tp_config(checkpoint, 2), checkpoint)
    try:
        tp = supervisor.start()
        assert (tp.rank, tp.size) == (0, 2)
        rank0 = ModelRunner(tp_config(checkpoint, 2), checkpoint, model_cfg, tp)
        assert rank0.kv_shape.num_kv_heads == 1 and single.kv_shape.num_kv_heads == 2
        page_table = torch.zeros(MAX_SLOTS + 1, 16, dtype=torch.int32)
        supervisor.attach(rank0, page_table, padding_slot=MAX_SLOTS)
        assert rank0.step_broadcaster is not None

        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (13, 7, 20)]
        reqs = [request_in_slot(i, p, page_table) for i, p in enumerate(prompts)]
        a, b, c = reqs
        # Chunked prefill over three steps, mixing a request's first and later chunks.
        steps = [[ScheduledChunk(a, 0, 8, False), ScheduledChunk(b, 0, 7, True)],
                 [ScheduledChunk(a, 8, 5, True), ScheduledChunk(c, 0, 10, False)],
                 [ScheduledChunk(c, 10, 10, True)]]
        for chunks in steps:
            batch = build_forward_batch(chunks, page_table, PAGE_SIZE, rank0.device)
            want, got = single.forward(batch), rank0.forward(batch)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            for ch in chunks:
                ch.request.kv_len += ch.length
        # Decode steps through the page-table decode batch (what CUDA graphs replay on GPUs).
        for _ in range(4):
            for r in reqs:
                r.output_ids.append(int(torch.randint(0, 256, (1,), generator=gen)))
            ids = torch.tensor([r.all_ids[-1] for r in reqs])
            positions = torch.tensor([r.total_len - 1 for r in reqs])
            slots = torch.tensor([r.slot for r in reqs])
            batch = decode_batch(ids, positions, slots, page_table, PAGE_SIZE)
            want, got = single.forward(batch), rank0.forward(batch)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert want.shape == (3, model_cfg.vocab_size)
        assert supervisor.check() is None
    finally:
        supervisor.stop()
    assert all(p.exitcode == 0 for p in supervisor.workers.values())


# ---- over HTTP: splitserve serve --tp-size 2 ------------------------------------------------------


def serve_args(checkpoint: Path, port: int, tp_size: int) -> list[str]:
    return ["serve", "--model", str(checkpoint), "--served-model-name", MODEL, "--port", str(port),
            "--page-size", str(PAGE_SIZE), "--chunked-prefill-size", "8", "--max-total-tokens", "2048",
            "--max-running-requests", "8", "--device", "cpu", "--tp-size", str(tp_size)]


def start(checkpoint: Path, tmp: Path, tp_size: int, name: str) -> tuple[ServerProcess, str]:
    port = free_port()
    proc = ServerProcess(serve_args(checkpoint, port, tp_size), tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc.proc, 120, proc.log)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def prompt_tokens_computed(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("splitserve_prompt_tokens_computed_total"))


async def greedy_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        calls = [client.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}) for p in prompts]
        responses = await asyncio.gather(*calls)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["token_ids"] for r in responses]


@pytest.mark.slow
def test_greedy_output_of_tp2_server_equals_tp1_for_concurrent_requests(checkpoint: Path, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 256, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 6, 17)]
    prompts += [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 25)]
    sampled = torch.randint(0, 256, (14,), generator=gen).tolist()  # n = 3: samples 2, 3 copy its last page
    outputs, samples = {}, {}
    for tp_size in (1, 2):
        proc, url = start(checkpoint, tmp_path, tp_size, f"tp{tp_size}")
        try:
            outputs[tp_size] = asyncio.run(greedy_all(url, prompts, max_tokens=16))
            before = prompt_tokens_computed(url)
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": sampled, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "n": 3, "logprobs": 1})
            assert r.status_code == 200, r.text
            samples[tp_size] = [c["token_ids"] for c in r.json()["choices"]]
            # Every rank copied the page: the copies' logprobs are the first sample's (a rank that
            # read a stale page would move them, if not the tokens).
            first, *copies = [c["logprobs"]["token_logprobs"] for c in r.json()["choices"]]
            for lps in copies:
                assert lps == pytest.approx(first, abs=1e-4)
            assert prompt_tokens_computed(url) - before == 14 + 2 * 1
            assert_kv_back_to_start(url)
            state = engine_state(url)
            assert len(state["tp_worker_pids"]) == tp_size - 1
        finally:
            proc.stop()
        assert proc.proc.returncode == 0, proc.log.read_text()[-3000:]
    assert outputs[2] == outputs[1]
    assert samples[2] == samples[1] == [samples[1][0]] * 3


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_killed_worker_fails_running_and_new_requests_clearly_and_health_turns_503(
        checkpoint: Path, tmp_path: Path) -> None:
    proc, url = start(checkpoint, tmp_path, 2, "kill")
    try:
        worker = int(engine_state(url)["tp_worker_pids"]["1"])
        events: list[dict] = []
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": list(range(5, 40)), "max_tokens": 900, "temperature": 0,
                "ignore_eos": True, "stream": True}) as resp:
            killed_at = None
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[len("data: "):]))
                if killed_at is None and len(events) >= 3:
                    os.kill(worker, 9)
                    killed_at = time.monotonic()
            assert killed_at is not None
            assert time.monotonic() - killed_at < 15, "the stream did not end soon after the worker died"
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert errors and "tensor-parallel rank 1" in errors[0], events[-3:]

        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and "tensor-parallel rank 1" in health.json()["status"]
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4},
                       timeout=10)
        assert r.status_code == 503 and "exited" in r.json()["error"]["message"]
        assert time.monotonic() - started < 5
        assert_kv_back_to_start(url)
    finally:
        proc.stop()
    assert proc.proc.returncode == 0, "rank 0 did not shut down cleanly after losing its worker"


def test_health_reports_a_broken_group_as_soon_as_a_collective_outside_a_step_breaks(checkpoint: Path) -> None:
    # A transfer poll agreement that breaks fails its rooms' requests at once; /health must not answer "ok" to a
    # client that already got those errors, before the loop's next turn fails the engine. Checked on the loop
    # thread, in the same turn, so no later turn can have failed the engine first.
    from splitserve.api.engine_client import engine_health
    from splitserve.engine.engine import Engine

    engine = Engine(tp_config(checkpoint, 2))
    engine.start()
    seen: list[tuple[bool, dict, str | None]] = []
    try:
        assert engine_health(engine)[0]

        def break_group() -> None:
            engine.tp_supervisor.collective_failed(RuntimeError("a poll agreement broke"))
            seen.append((*engine_health(engine), engine.failure))

        engine.call_soon(break_group)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        (ok, body, engine_failure), = seen
        assert not ok and "tensor-parallel ranks stopped answering: a poll agreement broke" in body["status"]
        assert engine_failure is None  # the loop had not failed the engine yet: only the supervisor knew
    finally:
        engine.stop()


@pytest.mark.slow
def test_workers_exit_when_rank0_is_killed(checkpoint: Path, tmp_path: Path) -> None:
    proc, url = start(checkpoint, tmp_path, 2, "orphan")
    try:
        worker = int(engine_state(url)["tp_worker_pids"]["1"])
        proc.kill()
        assert wait_gone(worker, 20), f"worker {worker} outlived rank 0"
    finally:
        proc.stop()
