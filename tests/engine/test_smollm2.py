"""SmolLM2-135M-Instruct from its GGUF file: the engine's logits and greedy chat answers equal
transformers on the same file, served alone and through `splitserve up --prefill 1 --decode 1`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from servers import REPO, free_port, served, splitserve_env
from smollm2_reference import QUESTIONS, hf_greedy_chat, hf_model, hf_tokenizer

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_names import smollm2_file
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

pytestmark = pytest.mark.slow

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference_answers() -> dict[str, list[int]]:
    """transformers' greedy answer to each question, as token ids (the EOS it stops on included)."""
    return {q: hf_greedy_chat(q, MAX_TOKENS) for q in QUESTIONS}


def all_position_logits(runner: ModelRunner, chunk: ScheduledChunk, kv: KVCache) -> torch.Tensor:
    batch = build_forward_batch([chunk], kv.page_table, kv.page_size, runner.device)
    batch.logits_index = torch.arange(batch.input_ids.shape[0])
    return runner.model(batch, runner.kv_pool)


@torch.inference_mode()
def test_logits_of_prefill_chunks_and_decode_steps_equal_transformers() -> None:
    path = smollm2_file()
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=16, max_total_tokens=256,
                       max_running_requests=2)
    runner = ModelRunner(cfg, path, ModelConfig.from_checkpoint(path))
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 2, 512, runner.device)
    tok = hf_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tokenize=False,
                                                add_generation_prompt=True))
    decode_tokens = tok.encode(" The capital of France is Paris.")
    want = hf_model()(torch.tensor([prompt + decode_tokens])).logits[0]
    req = Request("r", list(prompt), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    got = []
    split = 21  # two prefill chunks, the second starting mid-page
    for start, length in ((0, split), (split, len(prompt) - split)):
        assert kv.grow(req, start + length)
        got.append(all_position_logits(runner, ScheduledChunk(req, start, length, True), kv))
        req.kv_len = start + length
    for token in decode_tokens:
        req.output_ids.append(token)
        assert kv.grow(req, req.kv_len + 1)
        got.append(all_position_logits(runner, ScheduledChunk(req, req.kv_len, 1, True), kv))
        req.kv_len += 1
    got_all = torch.cat(got)
    assert got_all.shape == want.shape == (len(prompt) + len(decode_tokens), 49152)
    torch.testing.assert_close(got_all, want, atol=5e-4, rtol=1e-5)  # measured: 5.6e-5 (logits up to 38)
    assert torch.equal(got_all.argmax(-1), want.argmax(-1))


def chat_answers(base_url: str, model: str) -> dict[str, tuple[list[int], str]]:
    answers = {}
    for question in QUESTIONS:
        r = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        answers[question] = (choice["token_ids"], choice["message"]["content"])
    return answers


def assert_answers_equal_transformers(answers: dict[str, tuple[list[int], str]],
                                      reference: dict[str, list[int]]) -> None:
    tok = hf_tokenizer()
    for question, want in reference.items():
        got_ids, text = answers[question]
        assert got_ids == want, (question, tok.decode(got_ids), tok.decode(want))
        assert text == tok.decode(want, skip_special_tokens=True)
    assert "Paris" in answers["What is the capital of France?"][1]


def test_greedy_chat_over_http_equals_transformers_generate(tmp_path, reference_answers) -> None:
    with served(["--model", "smollm2", "--device", "cpu"], tmp_path / "serve.log", timeout=180) as url:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["smollm2"]
        assert_answers_equal_transformers(chat_answers(url, "smollm2"), reference_answers)


def test_up_one_prefill_one_decode_answers_as_transformers_does(tmp_path, reference_answers) -> None:
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve", "up", "--prefill", "1", "--decode", "1",
                             "--model", "smollm2", "--device", "cpu", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=splitserve_env(), cwd=REPO.parent)
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"endpoint: http://127.0.0.1:{port}/v1", (line, log.seek(0) or log.read()[-3000:])
        assert_answers_equal_transformers(chat_answers(f"http://127.0.0.1:{port}", "smollm2"), reference_answers)
    finally:
        proc.terminate()
        try:
            assert proc.wait(timeout=40) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
