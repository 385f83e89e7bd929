"""One front door: the router tokenizes a text request once and hands the engines its token ids, signed with the
group's key (`prompt_token_ids`, `tokenizer_digest`, `prompt_signature`); the engines take them instead of
templating and tokenizing again, refuse ids a client made up, and still validate and shape everything else (tools,
response_format). Streams: the engine marks its first token, so a first token with no text yet (a special token,
part of a UTF-8 character) does not hold the stream back at the router.

Real processes on the tiny model: a lone unified engine (the reference), a unified engine behind a cache-aware
router and a prefill+decode pair behind another.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time

import httpx
import pytest
from servers import (
    TEST_CONTROL_KEY,
    LocalDeployment,
    ServerProcess,
    assert_kv_back_to_start,
    bootstrap_grant,
    engine_state,
    free_port,
)

from splitserve.api.openai_protocol import FIRST_TOKEN_EVENT
from splitserve.router.upstream import event_kind
from splitserve.transfer.bootstrap_grant import (
    PROMPT_DIGEST_FIELD,
    PROMPT_IDS_FIELD,
    PROMPT_SIGNATURE_FIELD,
    prompt_grant_valid,
    sign_prompt,
)

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cpu",
               "--transfer-control-key", TEST_CONTROL_KEY]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.5", "--transfer-bootstrap-timeout-s", "60"]
KEY = {"x-splitserve-key": TEST_CONTROL_KEY}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["answer", "n"]}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Oslo?"}]


# ---- the pieces, on their own ----------------------------------------------------------------------------

def test_prompt_grants_bind_the_ids_the_digest_and_the_key() -> None:
    sig = sign_prompt("k" * 32, "abc/hermes", [1, 2, 3])
    assert prompt_grant_valid("k" * 32, "abc/hermes", [1, 2, 3], sig)
    assert not prompt_grant_valid("k" * 32, "abc/hermes", [1, 2, 4], sig)
    assert not prompt_grant_valid("k" * 32, "abd/hermes", [1, 2, 3], sig)
    assert not prompt_grant_valid("other", "abc/hermes", [1, 2, 3], sig)
    assert not prompt_grant_valid("k" * 32, "abc/hermes", [1, 2, 3], None)
    assert not prompt_grant_valid("k" * 32, "abc/hermes", ["1", 2, 3], sig)  # not integers: refused, no raise
    assert not prompt_grant_valid("", "abc/hermes", [1, 2, 3], sig)


def test_the_first_token_marker_starts_a_stream_and_empty_chunks_do_not() -> None:
    assert event_kind(FIRST_TOKEN_EVENT).first_token and event_kind(FIRST_TOKEN_EVENT).token
    empty = b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'
    assert not event_kind(empty).token and not event_kind(empty).first_token
    assert event_kind(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n').token


def test_the_router_signs_the_ids_of_text_prompts_only() -> None:
    """Chats and text completions carry the router's ids, signed, with the tokenizer's digest and tool format; a
    prompt of token ids carries none (the body has them), nor does anything without a key; an image is not
    tokenized at all (the router cannot expand its tokens)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
    from splitserve.engine.checkpoints.tokenizer import TextTokenizer
    from splitserve.router.cache_routing import CacheAwareRouting
    from splitserve.router.prompt_pages import PromptTokenizer

    text = TextTokenizer(tiny_model_folder(0))
    tokenizer = PromptTokenizer({**text.parts(), "tool_format": "hermes"})
    poller = SimpleNamespace(tokenizers={tokenizer.digest: tokenizer}, page_size={})
    routing = CacheAwareRouting(None, poller, 1000, CollectorRegistry())  # type: ignore[arg-type]
    chat_body = {"model": "m", "messages": MESSAGES}
    prompt = routing.tokenize("/v1/chat/completions", chat_body, "k")
    assert prompt is not None and prompt.ids == tokenizer.prompt_ids("/v1/chat/completions", chat_body)
    assert prompt.fields[PROMPT_IDS_FIELD] == prompt.ids
    assert prompt.fields[PROMPT_DIGEST_FIELD] == f"{text.parts()['digest']}/hermes"
    fields = prompt.fields
    assert prompt_grant_valid("k", fields[PROMPT_DIGEST_FIELD], prompt.ids, fields[PROMPT_SIGNATURE_FIELD])
    completion = routing.tokenize("/v1/completions", {"prompt": "hello"}, "k")
    assert completion is not None and completion.ids == text.encode("hello") and completion.fields
    ids = routing.tokenize("/v1/completions", {"prompt": [256, 5, 6]}, "k")
    assert ids is not None and ids.ids == [256, 5, 6] and ids.fields == {}
    assert routing.tokenize("/v1/chat/completions", chat_body, "").fields == {}  # type: ignore[union-attr]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
    assert routing.tokenize("/v1/chat/completions", {"messages": [image]}, "k") is None
    assert routing.tokenize("/v1/completions", {"prompt": ["a", "b"]}, "k") is None  # two prompts


# ---- through real engines ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-door")
    d = LocalDeployment(tmp, "tiny", ENGINE_ARGS, TRANSFER_ARGS)
    try:
        lone, unified = d.engine("unified"), d.engine("unified")
        prefill, decode = d.engine("prefill"), d.engine("decode")
        d.wait([lone, unified, prefill, decode])
        pd = d.router([prefill], [decode], "--kv-events-interval-s", "0.05")
        port = free_port()
        routed = f"http://127.0.0.1:{port}"
        d.procs[routed] = ServerProcess(["router", "--port", str(port), "--transfer-control-key", TEST_CONTROL_KEY,
                                         "--unified", unified, "--kv-events-interval-s", "0.05"],
                                        tmp / f"router-{port}.log")
        d.ready_paths[routed] = "/ready"
        d.wait([pd, routed], timeout=60)
        info = httpx.get(f"{prefill}/health", timeout=5).json()
        g = {"d": d, "lone": lone, "unified": unified, "prefill": prefill, "decode": decode, "pd": pd,
             "routed": routed, "bootstrap": (info["bootstrap_host"], info["bootstrap_port"])}
        for router in (pd, routed):  # the routers tokenize once they have the engines' tokenizer
            wait_for_tokenizer(router)
        yield g
    finally:
        d.stop()


def wait_for_tokenizer(router: str, timeout: float = 30.0) -> None:
    """Until the router routes by cached prefix (it has fetched the engines' tokenizer)."""
    deadline = time.monotonic() + timeout
    body = {"model": "m", "prompt": "warm up", "max_tokens": 1}
    while True:
        assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(f"{router}/metrics", timeout=5).text
        if "splitserve_router_routed_prompt_tokens_total{" in metrics:
            return
        assert time.monotonic() < deadline, "the router never got the engines' tokenizer"
        time.sleep(0.1)


def digest_of(url: str) -> str:
    parts = httpx.get(f"{url}/internal/tokenizer", headers=KEY, timeout=10).json()
    return f"{parts['digest']}/{parts['tool_format']}"


def chat(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_chat(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"model": "m", "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [without_call_ids({k: v for k, v in json.loads(x).items() if k not in ("id", "created")})
            for x in lines[:-1]]


def without_call_ids(event: dict) -> dict:
    """Tool calls' ids are random: everything else must be equal."""
    for choice in event.get("choices") or []:
        for part in (choice.get("delta"), choice.get("message")):
            for call in (part or {}).get("tool_calls") or []:
                call.pop("id", None)
    return event


def answer(body: dict) -> tuple[list[dict], int, int]:
    return without_call_ids(body)["choices"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]


CHATS = [
    pytest.param({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 48}, id="tools"),
    pytest.param({"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 12}, id="tools-auto"),
    pytest.param({"messages": MESSAGES, "max_tokens": 40,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
                 id="response-format"),
    pytest.param({"messages": MESSAGES, "max_tokens": 8, "n": 2}, id="n2"),
]


@pytest.mark.parametrize("body", CHATS)
def test_chats_through_routers_equal_a_lone_engine(group, body: dict) -> None:
    """Chat with tools (a forced call and auto), with response_format and with n = 2: greedy through a router in
    front of a unified engine and in front of a 1P1D pair is the lone engine's answer, prompt ids included, streamed
    or not."""
    body = {**body, "return_token_ids": True}
    want = answer(chat(group["lone"], body))
    assert want[0][0]["prompt_token_ids"] and want[0][0]["token_ids"]
    for router in ("routed", "pd"):
        assert answer(chat(group[router], body)) == want, router
    if body.get("n", 1) == 1:
        want_stream = streamed_chat(group["lone"], body)
        for router in ("routed", "pd"):
            assert streamed_chat(group[router], body) == want_stream, router


def test_completions_with_a_text_prompt_through_routers_equal_a_lone_engine(group) -> None:
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "echo": True}
    want = httpx.post(f"{group['lone']}/v1/completions", json=body, timeout=60).json()
    for router in ("routed", "pd"):
        got = httpx.post(f"{group[router]}/v1/completions", json=body, timeout=60).json()
        assert answer(got) == answer(want), router


def test_an_engine_takes_the_signed_ids_as_the_prompt(group) -> None:
    """The ids win over the body's prompt: the engine neither templates nor tokenizes (the body's messages
    still must be valid)."""
    ids = [256, 72, 105, 33, 10]
    digest = digest_of(group["lone"])
    fields = {PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: digest,
              PROMPT_SIGNATURE_FIELD: sign_prompt(TEST_CONTROL_KEY, digest, ids)}
    got = chat(group["lone"], {"messages": MESSAGES, "max_tokens": 3, "return_token_ids": True, **fields})
    assert got["choices"][0]["prompt_token_ids"] == ids and got["usage"]["prompt_tokens"] == len(ids)
    want = httpx.post(f"{group['lone']}/v1/completions", timeout=60, json={
        "model": "m", "prompt": ids, "max_tokens": 3, "temperature": 0, "return_token_ids": True}).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    r = httpx.post(f"{group['lone']}/v1/chat/completions", timeout=60,  # the rest of the body is still checked
                   json={"model": "m", "messages": MESSAGES, "temperature": -1, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_ids_of_another_tokenizer_are_tokenized_again_and_logged_once(group) -> None:
    """A rolling update with two tokenizer revisions: the engine tokenizes the body itself."""
    ids, digest = [256, 1, 2, 3], "0123456789abcdef/other"
    fields = {PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: digest,
              PROMPT_SIGNATURE_FIELD: sign_prompt(TEST_CONTROL_KEY, digest, ids)}
    want = chat(group["lone"], {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    for _ in range(2):
        got = chat(group["lone"], {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True, **fields})
        assert got["choices"][0]["prompt_token_ids"] == want["choices"][0]["prompt_token_ids"]
    log = group["d"].procs[group["lone"]].log.read_text()
    assert log.count("the router tokenized with tokenizer 0123456789abcdef/other") == 1


@pytest.mark.parametrize("where", ["lone", "routed", "pd"])
def test_forged_prompt_token_ids_are_refused(group, where: str) -> None:
    """A client cannot hand an engine token ids as if the router had made them: without the router's signature
    (none, one under another key, one of other ids) they are a 401 naming the signature, from an engine or
    through a router, for chats and completions."""
    ids = [256, 1, 2, 3]
    digest = digest_of(group["lone"])
    forged = [{PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: digest},
              {PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: digest,
               PROMPT_SIGNATURE_FIELD: sign_prompt("not-the-group-key", digest, ids)},
              {PROMPT_IDS_FIELD: ids, PROMPT_DIGEST_FIELD: digest,
               PROMPT_SIGNATURE_FIELD: sign_prompt(TEST_CONTROL_KEY, digest, [256, 9, 9, 9])}]
    for fields in forged:
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
            r = httpx.post(f"{group[where]}{path}", json={"model": "m", "max_tokens": 2, **body, **fields}, timeout=60)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["param"] == PROMPT_SIGNATURE_FIELD
            assert r.json()["error"]["code"] == "prompt_not_granted"


def test_the_prefill_answers_a_handoff_with_a_small_body(group) -> None:
    host, port = group["bootstrap"]
    body = {"model": "m", "prompt": list(range(3, 23)), "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            **bootstrap_grant(host, port, secrets.randbits(63))}

    import threading
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=httpx.post(f"{group['prefill']}/v1/completions",
                                                                      json=body, timeout=60)))
    thread.start()
    decoded = httpx.post(f"{group['decode']}/v1/completions", json=body, timeout=60)
    thread.join(60)
    assert decoded.status_code == 200 and len(decoded.json()["choices"][0]["text"]) >= 0
    assert out["r"].status_code == 200, out["r"].text
    answer = out["r"].json()
    marks = answer.pop("phase_marks")  # where its time went (engine/phase_timing.py), in the order it got there
    assert answer == {"prefilled": True, "prompt_tokens": 20, "cached_tokens": 0}
    assert list(marks) == ["taken", "bootstrapped", "scheduled", "first_token", "shipped", "written"]
    assert list(marks.values()) == sorted(marks.values())


# ---- streams flow ------------------------------------------------------------------------------------------

SKIPPED_SPECIAL = 258  # <|im_start|>: decodes to no text (special tokens are skipped)
UTF8_LEAD = 0xF0  # the byte that opens a 4-byte UTF-8 character: text only once the character is whole


@pytest.mark.parametrize("token", [SKIPPED_SPECIAL, UTF8_LEAD])
@pytest.mark.parametrize("where", ["routed", "pd"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_whose_tokens_have_no_text_yet_flows_through_the_router(group, where: str, token: int,
                                                                         path: str) -> None:
    """Every token is one with no text (logit_bias): the router used to hold the stream until a chunk with text
    or the finish, here the very end. Now the client has the first token's chunk while the engine still
    generates the rest."""
    engine = group["unified"] if where == "routed" else group["decode"]
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    body = {"model": "m", **prompt, "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "logit_bias": {str(token): 100}, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{group[where]}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a line iterator dropped mid-stream closes the connection
        for line in lines:
            if not line.startswith("data: "):
                assert not line.startswith(":"), "the router relayed the engine's first-token marker"
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("delta", {}).get("role") is None:  # past a chat's role chunk: the first token's
                break
        first_at = time.monotonic() - started
        assert engine_state(engine)["running"] == 1, f"the first chunk came after the stream ended ({first_at:.2f} s)"
        assert choice.get("text", "") == "" and not choice.get("delta") and choice["finish_reason"] is None
        later = sum(1 for line in itertools.islice(lines, 40) if line.startswith("data: "))
        assert later == 20  # the next tokens flow too (an event and a blank line each)
    assert_kv_back_to_start(engine, timeout=20)  # the client left: aborted, pages back
