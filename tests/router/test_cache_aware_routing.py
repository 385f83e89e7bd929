"""Cache-aware routing through real engines: a prompt goes where its prefix is cached (the engines' page
events tell the router), a new prefix goes where it adds least work, and the router's tokenizer is the
engines' own (fetched from them), for completions and chats alike."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_group import ServerGroup
from servers import TEST_CONTROL_KEY

from splitserve.engine.checkpoints.tiny_model import tiny_model_folder

pytestmark = pytest.mark.slow

ENGINE = ["--served-model-name", "m", "--device", "cpu", "--page-size", "4", "--max-total-tokens", "4096",
          "--transfer-control-key", TEST_CONTROL_KEY]
PREFIX_LEN = 64


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = ServerGroup(tmp_path_factory.mktemp("cache-aware"), tiny_model_folder(0), ENGINE)
    urls = [g.engine(f"unified-{i}", "unified") for i in range(3)]
    for name, routing in (("router", "cache-aware"), ("router-least-loaded", "least-loaded")):
        g.start(name, ["router", "--unified", *urls, "--routing", routing, "--transfer-control-key",
                       TEST_CONTROL_KEY, "--kv-events-interval-s", "0.05", "--health-interval-s", "0.5"])
    try:
        # Each router routes to all three engines once this returns: least-loaded turns over two would put every
        # repeat after the first two turns where its prefix was (14 of 21 hits, where three engines give 7).
        g.wait()
        yield g
    finally:
        g.stop()


def complete(router: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{router}/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def run_turns(router: str, seed: int) -> tuple[list[int], int]:
    """Seven prefixes (not a multiple of the three engines, so turns in order do not line up with them), each
    asked four times with a fresh question: the cached tokens of every repeat, and of every request."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX_LEN)] for _ in range(7)]
    hits, total = [], 0
    for turn in range(4):
        for prefix in prefixes:
            usage = complete(router, prefix + [rng.randrange(3, 250) for _ in range(9)])
            total += cached(usage)
            if turn:
                hits.append(cached(usage))
    return hits, total


def metric_sum(router: str, name: str) -> float:
    """A counter's samples summed over its labels (every backend)."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_repeats_of_a_prefix_find_it_cached_where_least_loaded_routing_does_not(group) -> None:
    router = group.url("router")
    reported = metric_sum(router, "splitserve_router_reported_cached_tokens_total")
    predicted = metric_sum(router, "splitserve_router_predicted_cached_tokens_total")
    aware, total = run_turns(router, seed=1)
    assert all(h >= PREFIX_LEN for h in aware), aware  # every repeat found its whole prefix
    blind, _ = run_turns(group.url("router-least-loaded"), seed=2)  # requests in turn over three engines
    assert sum(h >= PREFIX_LEN for h in blind) <= len(blind) // 2, blind
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    assert 'splitserve_router_route_decisions_total{reason="cache"}' in metrics
    assert "splitserve_router_route_decision_seconds_count" in metrics
    # Per backend, what the engines reported of their caches beside what the router predicted: the engines'
    # counts are the clients' (usage), and the prediction (whole pages the events showed) never exceeds them.
    got = metric_sum(router, "splitserve_router_reported_cached_tokens_total") - reported
    assert got == total > 0
    assert 0.75 * got <= metric_sum(router, "splitserve_router_predicted_cached_tokens_total") - predicted <= got


def test_a_streamed_answer_reports_its_cached_tokens_to_the_router(group) -> None:
    router = group.url("router")
    prompt = [random.Random(5).randrange(3, 250) for _ in range(PREFIX_LEN)]
    complete(router, [*prompt, 7])
    before = metric_sum(router, "splitserve_router_reported_cached_tokens_total")
    with httpx.stream("POST", f"{router}/v1/completions", timeout=60, json={
            "model": "m", "prompt": [*prompt, 9], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    usage = [e for e in events if '"usage": {' in e or '"usage":{' in e][-1]
    hit = cached(json.loads(usage[len("data: "):])["usage"])
    assert hit >= PREFIX_LEN
    assert metric_sum(router, "splitserve_router_reported_cached_tokens_total") - before == hit


def test_chat_turns_of_one_conversation_stay_where_their_history_is(group) -> None:
    router = group.url("router")
    messages = [{"role": "system", "content": "You answer briefly. " * 12}]
    hits = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"question number {turn} about the weather in town {turn}"})
        r = httpx.post(f"{router}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        answer = r.json()
        hits.append(cached(answer["usage"]) / answer["usage"]["prompt_tokens"])
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"})
    assert min(hits[1:]) > 0.5, hits  # each turn reuses the history the previous turn left


def test_the_router_tokenizes_with_the_engines_tokenizer(group) -> None:
    parts = httpx.get(f"{group.url('unified-0')}/internal/tokenizer", timeout=10,
                      headers={"x-splitserve-key": TEST_CONTROL_KEY}).json()
    assert {"tokenizer_json", "chat_template", "digest", "tool_format"} <= set(parts)
    assert httpx.get(f"{group.url('unified-0')}/internal/tokenizer", timeout=10).status_code == 401
