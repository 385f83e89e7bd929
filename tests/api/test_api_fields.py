"""No request field is silently ignored: every field the official `openai` client can send is
implemented, ignored on purpose (the README lists those), or refused with a 400 naming it."""

from __future__ import annotations

import pytest
from servers import assert_kv_back_to_start, served

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]

# field -> (a value a client might send, whether this server serves it)
CHAT_FIELDS = {
    "frequency_penalty": (0.5, True), "logit_bias": ({"65": 1.0}, True), "logprobs": (True, True),
    "max_completion_tokens": (3, True), "max_tokens": (3, True), "metadata": ({"k": "v"}, True),
    "n": (2, True), "presence_penalty": (0.5, True), "prompt_cache_key": ("k", True),
    "prompt_cache_options": ({}, True), "prompt_cache_retention": ("in_memory", True),
    "safety_identifier": ("s", True), "seed": (3, True), "service_tier": ("auto", True), "stop": (["x"], True),
    "store": (False, True), "stream_options": (None, True), "temperature": (0.5, True),
    "top_logprobs": (2, True), "top_p": (0.9, True), "user": ("u", True), "parallel_tool_calls": (True, True),
    "response_format": ({"type": "text"}, True), "modalities": (["text"], True), "tool_choice": ("none", True),
    "audio": ({"voice": "alloy", "format": "wav"}, False), "prediction": ({"type": "content", "content": "x"}, False),
    "function_call": ("auto", False), "functions": ([{"name": "f"}], False), "moderation": ({}, False),
    "reasoning_effort": ("low", False), "verbosity": ("low", False), "web_search_options": ({}, False),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], True),
}
COMPLETION_FIELDS = {
    "best_of": (3, False), "echo": (True, True), "frequency_penalty": (0.5, True), "logit_bias": ({"65": 1.0}, True),
    "logprobs": (2, True), "max_tokens": (3, True), "n": (2, True), "presence_penalty": (0.5, True),
    "seed": (3, True), "stop": ("x", True), "stream_options": (None, True), "suffix": ("tail", False),
    "temperature": (0.5, True), "top_p": (0.9, True), "user": ("u", True),
}
REQUIRED = {"messages", "model", "prompt"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    with served(["--model", "tiny", "--device", "cpu", "--max-total-tokens", "2048", "--max-running-requests", "4"],
                tmp_path_factory.mktemp("log") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def test_every_field_of_the_client_is_classified() -> None:
    """A field a new client release adds must be classified here before this test passes."""
    assert set(chat_params.CompletionCreateParamsBase.__annotations__) - REQUIRED == set(CHAT_FIELDS)
    assert set(completion_params.CompletionCreateParamsBase.__annotations__) - REQUIRED == set(COMPLETION_FIELDS)


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_chat_field(client: openai.OpenAI, server: str, field: str) -> None:
    value, served = CHAT_FIELDS[field]
    body = {field: value} if value is not None else {"stream_options": {"include_usage": True}, "stream": True}
    kwargs = {"max_tokens": 3, **body} if field not in ("max_tokens", "max_completion_tokens") else body
    if not served:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert err.value.body["param"] == field and field in err.value.body["message"]
    else:
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        if kwargs.get("stream"):
            out = list(out)
            assert out[-1].usage is not None
        else:
            assert out.choices[0].message.role == "assistant"
    assert_kv_back_to_start(server)


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_completion_field(client: openai.OpenAI, server: str, field: str) -> None:
    value, served = COMPLETION_FIELDS[field]
    body = {field: value} if value is not None else {"stream_options": {"include_usage": True}, "stream": True}
    kwargs = {"max_tokens": 3, **body} if field != "max_tokens" else body
    if not served:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="hi", **kwargs)
        assert err.value.body["param"] == field and field in err.value.body["message"]
    else:
        out = client.completions.create(model=MODEL, prompt="hi", **kwargs)
        if kwargs.get("stream"):
            assert list(out)[-1].usage is not None
        else:
            assert out.choices[0].finish_reason in ("stop", "length")
    assert_kv_back_to_start(server)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_unknown_field_gets_a_400_naming_it(client: openai.OpenAI, kind: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"frobnicate": 1})
        else:
            client.completions.create(model=MODEL, prompt="hi", extra_body={"frobnicate": 1})
    assert err.value.body["param"] == "frobnicate"
    assert "'frobnicate' is not supported" in err.value.body["message"]


def test_unknown_stream_option_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", stream=True,
                                  stream_options={"continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    assert err.value.body["param"] == "stream_options"
