"""The unified engine over real HTTP: greedy parity with transformers, sampling, stops, streaming."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import assert_kv_back_to_start, served

transformers = pytest.importorskip("transformers")

MODEL = "parity-llama"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory) -> str:
    # Small pages and a small chunk size so that a batch of prompts exercises chunked prefill,
    # page boundaries and prefix sharing.
    with served(["--model", str(checkpoint), "--served-model-name", MODEL, "--page-size", "4",
                 "--chunked-prefill-size", "8", "--max-total-tokens", "4096", "--max-running-requests", "8",
                 "--device", "cpu"], tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


@pytest.fixture(autouse=True)
def kv_back_to_start(server: str):
    yield
    assert_kv_back_to_start(server)


def complete(server: str, **body) -> dict:
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def hf_greedy(checkpoint: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                           eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            # An explicit mask: otherwise generate() infers one from pad_token_id and masks real 0 tokens.
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(out[0, len(p):].tolist())
    return outs


def test_concurrent_greedy_generation_matches_transformers_token_for_token(server: str, checkpoint: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (21,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 5, 12, 30)]
    prompts += [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (2, 9, 40)]
    max_new = 24
    # Warm the prefix cache with the shared prefix so the batch below hits it.
    complete(server, prompt=[*shared, 1], max_tokens=1, temperature=0)

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [client.post(f"{server}/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": max_new, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}) for p in prompts]
            return [r.json() for r in await asyncio.gather(*calls)]

    results = asyncio.run(run_all())
    got = [r["choices"][0]["token_ids"] for r in results]
    assert [r["choices"][0]["prompt_token_ids"] for r in results] == prompts
    assert got == hf_greedy(checkpoint, prompts, max_new)
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results[:4]]
    assert all(c >= 20 for c in cached), f"shared prefix not served from the prefix cache: {cached}"


def test_seeded_sampling_is_reproducible_and_seed_dependent(server: str) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "return_token_ids": True, "ignore_eos": True}
    a = complete(server, seed=11, **body)["choices"][0]["token_ids"]
    b = complete(server, seed=11, **body)["choices"][0]["token_ids"]
    c = complete(server, seed=12, **body)["choices"][0]["token_ids"]
    assert a == b
    assert a != c


def test_logit_bias_forces_a_token(server: str) -> None:
    out = complete(server, prompt="abc", max_tokens=6, temperature=0, logit_bias={"65": 100},
                   return_token_ids=True, ignore_eos=True)
    assert out["choices"][0]["token_ids"] == [65] * 6
    assert out["choices"][0]["text"] == "A" * 6


def test_repetition_penalty_keeps_seen_tokens_out(server: str) -> None:
    prompt = list(range(40, 60))
    plain = complete(server, prompt=prompt, max_tokens=30, temperature=0, ignore_eos=True, return_token_ids=True)
    penal = complete(server, prompt=prompt, max_tokens=30, temperature=0, ignore_eos=True, return_token_ids=True,
                     repetition_penalty=100.0)
    toks = penal["choices"][0]["token_ids"]
    assert len(set(toks)) == len(toks), "a token repeated despite the huge repetition penalty"
    assert not set(toks) & set(prompt)
    assert toks != plain["choices"][0]["token_ids"]


def test_stop_string_cuts_text_and_finishes_with_stop(server: str) -> None:
    base = complete(server, prompt="Hello there", max_tokens=40, temperature=0, ignore_eos=True,
                    logit_bias={str(t): 8.0 for t in range(97, 123)})  # favour ascii letters: readable text
    text = base["choices"][0]["text"]
    stop = text[10:12]
    cut = complete(server, prompt="Hello there", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop],
                   logit_bias={str(t): 8.0 for t in range(97, 123)})
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.find(stop)]


def test_stop_token_id_ends_generation(server: str) -> None:
    base = complete(server, prompt="Hello", max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True)
    toks = base["choices"][0]["token_ids"]
    stop_id = toks[4]
    cut = complete(server, prompt="Hello", max_tokens=12, temperature=0, ignore_eos=True, return_token_ids=True,
                   stop_token_ids=[stop_id])
    assert cut["choices"][0]["token_ids"] == toks[: toks.index(stop_id) + 1]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_finishes_with_length(server: str) -> None:
    out = complete(server, prompt="Hi", max_tokens=3, temperature=0, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 3


def test_streaming_arrives_incrementally_and_matches_non_streamed(server: str) -> None:
    body = {"model": MODEL, "prompt": "Streaming test", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    whole = complete(server, **{k: v for k, v in body.items() if k != "model"})["choices"][0]["text"]
    events = []
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 10, "expected one event per token or so, got the output in few pieces"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_the_chat_template(server: str, checkpoint: Path) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant"
    # <|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n
    expected_prompt = [256, 258, *b"user\nhi", 259, 10, 258, *b"assistant\n"]
    assert choice["prompt_token_ids"] == expected_prompt
    assert len(choice["token_ids"]) == 5


def test_streaming_chat_sends_role_then_content(server: str) -> None:
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_streamed_usage_counts_cached_prompt_tokens_as_the_answer_does(server: str) -> None:
    prompt = list(range(60, 90))
    complete(server, prompt=prompt, max_tokens=1, temperature=0)  # now cached
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answered = complete(server, **{k: v for k, v in body.items() if k != "model"})["usage"]
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert answered["prompt_tokens_details"]["cached_tokens"] >= 16
    assert events[-1]["usage"] == answered


def test_logprobs_are_reported_for_top_n(server: str) -> None:
    out = complete(server, prompt="abc", max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert chosen <= 0.0


def test_n_choices_and_batched_prompts(server: str) -> None:
    out = complete(server, prompt=["one", "two"], n=2, max_tokens=3, temperature=0, ignore_eos=True)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    texts = {c["index"]: c["text"] for c in out["choices"]}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: n copies agree
    assert out["usage"]["completion_tokens"] == 12


def test_client_disconnect_mid_stream_frees_its_pages(server: str) -> None:
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x" * 50, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    state = assert_kv_back_to_start(server)
    assert state["requests"] == 0


def test_client_disconnect_while_waiting_non_streamed_aborts(server: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", timeout=0.5, json={
            "model": MODEL, "prompt": "y" * 30, "max_tokens": 900, "temperature": 0, "ignore_eos": True})
    assert_kv_back_to_start(server)


def test_metrics_expose_latency_histograms_and_kv_gauges(server: str) -> None:
    complete(server, prompt="metrics", max_tokens=4, temperature=0)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for name in ("splitserve_time_to_first_token_seconds_bucket", "splitserve_inter_token_latency_seconds_bucket",
                 "splitserve_requests_running", "splitserve_requests_waiting", "splitserve_kv_pages_used",
                 "splitserve_kv_pages_free", "splitserve_prefix_cache_hit_rate", "splitserve_prompt_tokens_total",
                 "splitserve_generation_tokens_total"):
        assert name in text, name
    ttft_count = [line for line in text.splitlines() if line.startswith("splitserve_time_to_first_token_seconds_count")]
    assert float(ttft_count[0].split()[-1]) >= 1


def test_models_and_health(server: str) -> None:
    models = httpx.get(f"{server}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_unknown_path_and_wrong_method_get_openai_json_errors(server: str) -> None:
    """Starlette's own 404 and 405 come as the same JSON error body as the API's 400s, not plain text."""
    r = httpx.post(f"{server}/v1/no-such-endpoint", json={}, timeout=10)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "not_found", err
    assert "POST /v1/no-such-endpoint" in err["message"] and "param" in err
    r = httpx.get(f"{server}/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["content-type"] == "application/json", r.text
    assert r.headers["allow"] == "POST"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "method_not_allowed", err
    assert "GET /v1/completions" in err["message"] and "POST" in err["message"]


def test_max_tokens_over_the_context_gets_a_400_naming_both_numbers(server: str) -> None:
    """The model's context is 1024 tokens: a prompt plus the max_tokens asked for must fit in it, as in vLLM."""
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": [5] * 10, "max_tokens": 100_000},
                   timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == ("This model's maximum context length is 1024 tokens. However, you requested 100010 "
                              "tokens (10 in the prompt, 100000 in the completion). Please reduce the length of "
                              "the prompt or completion."), err
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1024}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "maximum context length is 1024 tokens" in message and "in the messages, 1024 in the completion" in message
    # Exactly the context is fine; without max_tokens the default shrinks to the room the prompt leaves.
    out = complete(server, prompt=[5] * 1018, max_tokens=6, temperature=0, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 6
    out = complete(server, prompt=[5] * 1020, temperature=0, ignore_eos=True)  # the default is 16 tokens
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{server}/v1/chat/completions", json={**chat, "max_completion_tokens": None}, timeout=60)
    assert r.status_code == 200, r.text


BAD_REQUESTS = [
    ("invalid json", b"{not json", 400),
    ("empty body", b"", 400),
    ("body is a list", [1, 2], 400),
    ("missing prompt", {"model": MODEL}, 400),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400),
    ("prompt wrong type", {"model": MODEL, "prompt": 12}, 400),
    ("token id out of vocab", {"model": MODEL, "prompt": [1, 2, 99999]}, 400),
    ("negative token id", {"model": MODEL, "prompt": [-1]}, 400),
    ("mixed prompt list", {"model": MODEL, "prompt": ["a", 1]}, 400),
    ("negative max_tokens", {"model": MODEL, "prompt": "a", "max_tokens": -5}, 400),
    ("zero max_tokens", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400),
    ("huge max_tokens over context", {"model": MODEL, "prompt": "a" * 1100, "max_tokens": 10**9}, 400),
    ("max_tokens over the room the prompt leaves", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 1015}, 400),
    ("max_tokens a string", {"model": MODEL, "prompt": "a", "max_tokens": "ten"}, 400),
    ("max_tokens a float", {"model": MODEL, "prompt": "a", "max_tokens": 1.5}, 400),
    ("negative temperature", {"model": MODEL, "prompt": "a", "temperature": -1}, 400),
    ("top_p zero", {"model": MODEL, "prompt": "a", "top_p": 0}, 400),
    ("top_k negative", {"model": MODEL, "prompt": "a", "top_k": -2}, 400),
    ("min_p above one", {"model": MODEL, "prompt": "a", "min_p": 1.5}, 400),
    ("presence penalty out of range", {"model": MODEL, "prompt": "a", "presence_penalty": 3}, 400),
    ("repetition penalty zero", {"model": MODEL, "prompt": "a", "repetition_penalty": 0}, 400),
    ("logit bias bad key", {"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, 400),
    ("logit bias token out of vocab", {"model": MODEL, "prompt": "a", "logit_bias": {"5000": 1}}, 400),
    ("logit bias too large", {"model": MODEL, "prompt": "a", "logit_bias": {"5": 1000}}, 400),
    ("stop wrong type", {"model": MODEL, "prompt": "a", "stop": 5}, 400),
    ("n zero", {"model": MODEL, "prompt": "a", "n": 0}, 400),
    ("logprobs too many", {"model": MODEL, "prompt": "a", "logprobs": 50}, 400),
    ("stream not a bool", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400),
    ("unknown model", {"model": "gpt-9", "prompt": "a"}, 404),
    ("prompt longer than context", {"model": MODEL, "prompt": [5] * 1024}, 400),
    ("stream_options without stream", {"model": MODEL, "prompt": "a", "stream_options": {"include_usage": True}}, 400),
]


@pytest.mark.parametrize("body,status", [(b, s) for _, b, s in BAD_REQUESTS], ids=[n for n, _, _ in BAD_REQUESTS])
def test_bad_completion_request_gets_clear_4xx_and_server_keeps_serving(server: str, body, status: int) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{server}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=10)
    else:
        r = httpx.post(f"{server}/v1/completions", json=body, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    assert complete(server, prompt="still alive", max_tokens=2, temperature=0)["choices"][0]["finish_reason"]


BAD_CHATS = [
    ("no messages", {"model": MODEL}),
    ("messages empty", {"model": MODEL, "messages": []}),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
    ("content not text", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
]


@pytest.mark.parametrize("body", [b for _, b in BAD_CHATS], ids=[n for n, _ in BAD_CHATS])
def test_bad_chat_request_gets_400(server: str, body: dict) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    # A bad content part is named exactly (messages[i].content[j]); the rest name 'messages'.
    assert r.json()["error"]["param"].startswith("messages")
