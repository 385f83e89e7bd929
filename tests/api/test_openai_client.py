"""The official `openai` client against real servers: a unified engine and a 1P1D deployment
(prefill + decode + router, Mooncake TCP on loopback), for every feature, streaming and not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from servers import LocalDeployment, assert_kv_back_to_start

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "4096", "--max-running-requests", "8", "--device", "cpu"]
TRANSFER_ARGS = ["--transfer-heartbeat-interval-s", "0.2", "--transfer-heartbeat-misses", "5",
                 "--transfer-bootstrap-timeout-s", "5"]
MODEL = "m"
SHAPES = ["unified", "1p1d"]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "capital": {"type": "boolean"},
        "zone": {"enum": ["north", "south"]},
    },
    "required": ["city", "population", "capital", "zone"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = LocalDeployment(tmp_path_factory.mktemp("oa"), Path("tiny"), ENGINE_ARGS, TRANSFER_ARGS)
    try:
        unified, prefill, decode = d.engine("unified"), d.engine("prefill"), d.engine("decode")
        d.wait([unified, prefill, decode])
        router = d.router([prefill], [decode])
        d.wait([router], timeout=60)
        yield {"deployment": d, "unified": unified, "1p1d": router, "engines": [unified, prefill, decode]}
    finally:
        d.stop()


@pytest.fixture(autouse=True)
def pages_back_everywhere(deployment):
    yield
    for url in deployment["engines"]:
        assert_kv_back_to_start(url)


def client_for(deployment, shape: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment[shape]}/v1", api_key="none", max_retries=0, timeout=120)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else choice.text
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_every_time(deployment, shape: str, stream: bool) -> None:
    client = client_for(deployment, shape)
    for seed in range(4):
        kwargs = dict(model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA_FORMAT, max_tokens=200,
                      temperature=1.0, seed=seed)
        if stream:
            text, finish = streamed_text(client.chat.completions.create(stream=True, **kwargs))
        else:
            out = client.chat.completions.create(**kwargs)
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("shape", SHAPES)
def test_json_object_gives_a_json_object(deployment, shape: str) -> None:
    client = client_for(deployment, shape)
    close = str(ord("}"))  # the tiny model's byte tokens: pushing '}' ends the object soon
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=300, logit_bias={close: 8.0}, seed=1)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_and_sglang_extensions(deployment, shape: str, stream: bool) -> None:
    client = client_for(deployment, shape)
    cases = [({"guided_regex": "[a-d]{3}-[0-9]{2}"}, r"[a-d]{3}-[0-9]{2}"),
             ({"regex": "(yes|no)!"}, r"(yes|no)!"),
             ({"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
             ({"guided_grammar": 'root ::= "<" [a-z]+ ">"'}, r"<[a-z]+>"),
             ({"ebnf": 'root ::= ("ab")+ "."'}, r"(ab)+\."),
             ({"guided_json": SCHEMA}, None), ({"json_schema": json.dumps(SCHEMA)}, None)]
    for extra, pattern in cases:
        out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=200, seed=3, stream=stream,
                                        extra_body=extra)
        text, finish = streamed_text(out) if stream else (out.choices[0].text, out.choices[0].finish_reason)
        assert finish == "stop", (extra, text)
        if pattern is None:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(pattern, text), (extra, text)


def test_the_grammar_state_travels_from_prefill_to_decode(deployment) -> None:
    """Greedy under a grammar: the 1P1D deployment (first token sampled on prefill under the grammar,
    decode rebuilding the state from it) gives the unified engine's output token for token."""
    outputs = {}
    for shape in SHAPES:
        out = client_for(deployment, shape).completions.create(
            model=MODEL, prompt="x", max_tokens=120, temperature=0, extra_body={"guided_json": SCHEMA,
                                                                                "return_token_ids": True})
        outputs[shape] = out.choices[0].model_extra["token_ids"]
        jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    assert outputs["unified"] == outputs["1p1d"]


@pytest.mark.parametrize("shape", SHAPES)
def test_bad_constraints_get_a_400_naming_the_field(deployment, shape: str) -> None:
    client = client_for(deployment, shape)
    for extra, field in [({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"guided_regex": "a", "regex": "b"}, "regex"),
                         ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"ebnf": "root ::= "}, "ebnf")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == field, err.value.body


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_n_and_prompt_lists(deployment, shape: str, stream: bool) -> None:
    client = client_for(deployment, shape)
    prompts = ["one", "two", "three"]
    kwargs = dict(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0, stream=stream)
    if stream:
        texts: dict[int, str] = {}
        usage = None
        for chunk in client.completions.create(stream_options={"include_usage": True}, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
    else:
        out = client.completions.create(**kwargs)
        texts, usage = {c.index: c.text for c in out.choices}, out.usage
    assert sorted(texts) == list(range(6))
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's samples agree
    assert usage.prompt_tokens == sum(len(p) + 1 for p in prompts)  # + BOS each, counted once per prompt
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4, seed=5)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert 3 <= chat.usage.completion_tokens <= 12


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def chat_calls(client, stream: bool, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason), streamed or not."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
        m = out.choices[0].message
        return m.content, [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], \
            out.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] += d.id or ""
                entry[1] += d.function.name or ""
                entry[2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_are_valid_for_the_schema(deployment, shape: str, stream: bool) -> None:
    client = client_for(deployment, shape)
    for seed in range(3):
        content, calls, finish = chat_calls(client, stream, tools=[WEATHER, TIME], tool_choice="required",
                                            max_tokens=400, seed=seed, logit_bias={str(ord("]")): 4.0})
        assert finish == "tool_calls" and content is None and calls
        for call_id, name, arguments in calls:
            assert call_id.startswith("call_")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    content, calls, finish = chat_calls(client, stream, tools=[WEATHER, TIME], max_tokens=200, seed=1,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert finish == "stop" and [c[1] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][2]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_from_the_output(deployment, shape: str, stream: bool) -> None:
    """The output is steered (guided_regex) into a Hermes call after some text: the parser finds it."""
    client = client_for(deployment, shape)
    steer = ('Let me check[.]\n<tool_call>\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "[a-z]{2,5}", "days": 3\\}\\}\n</tool_call>')
    content, calls, finish = chat_calls(client, stream, tools=[WEATHER], max_tokens=200,
                                        extra_body={"guided_regex": steer})
    assert finish == "tool_calls" and content == "Let me check."
    assert [c[1] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][2]), SCHEMAS["get_weather"])
    # tool_choice none: the same output stays text
    content, calls, finish = chat_calls(client, stream, tools=[WEATHER], tool_choice="none", max_tokens=200,
                                        extra_body={"guided_regex": steer})
    assert calls == [] and finish == "stop" and "<tool_call>" in content


@pytest.mark.parametrize("shape", SHAPES)
def test_streamed_tool_calls_arrive_as_deltas_that_add_up_to_the_answer(deployment, shape: str) -> None:
    """Streamed, a call's name comes first and its arguments in fragments over several chunks; the
    accumulated deltas equal the non-streamed answer (content, calls, finish reason)."""
    client = client_for(deployment, shape)
    steer = ('Let me check[.]\n<tool_call>\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "[a-z]{2,5}", "days": 3\\}\\}\n</tool_call>')
    for kwargs in (dict(tools=[WEATHER], max_tokens=200, seed=3, extra_body={"guided_regex": steer}),
                   dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, seed=2,
                        logit_bias={str(ord("]")): 4.0})):
        whole = chat_calls(client, False, **kwargs)
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs))
        with_calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(with_calls) > 2, with_calls  # not one whole call at the end
        first = with_calls[0][0]
        assert first.index == 0 and first.id.startswith("call_") and first.type == "function" and first.function.name
        assert all(d.id is None and d.function.name is None for d in with_calls[1])
        streamed = chat_calls(client, True, **kwargs)
        assert (streamed[0], [c[1:] for c in streamed[1]], streamed[2]) == (whole[0], [c[1:] for c in whole[1]],
                                                                            whole[2])
        assert whole[1] and whole[2] == "tool_calls"


def test_tool_results_render_back(deployment) -> None:
    from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
    from splitserve.engine.checkpoints.tokenizer import TextTokenizer

    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = client_for(deployment, "1p1d").chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=2, extra_body={"return_token_ids": True})
    prompt = TextTokenizer(tiny_model_folder(0)).decode(out.choices[0].model_extra["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # this template renders no tools itself
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_a_client_leaving_a_fanned_out_stream_frees_every_sequence(deployment) -> None:
    """n = 3 through 1P1D, streamed; the client reads one event and leaves: every sequence is
    aborted on the engines (the autouse check: all pages back, no request left)."""
    import httpx

    body = {"model": MODEL, "prompt": "leave", "n": 3, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{deployment['1p1d']}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
