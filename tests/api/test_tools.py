"""Tool calling without a server: the request fields, the call formats read back from output,
calls held back in a stream, tools rendered for templates with and without tool support, and
forced calls under the grammar (always valid JSON for the function's schema)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from splitserve.api.tools.forcing import forced_call_grammar
from splitserve.api.tools.formats import format_for, messages_for_template, parse_calls
from splitserve.api.tools.request import InvalidTools, tool_request_from
from splitserve.api.tools.streaming import ToolCallStream, final_message
from splitserve.engine.checkpoints.tiny_model import EOS, tiny_model_folder
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.grammar.compiler import GrammarCompiler
from splitserve.engine.grammar.slots import GrammarSlots
from splitserve.engine.sampling import FullSampler, SamplingBatch
from splitserve.engine.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_request_fields() -> None:
    assert tool_request_from({}) is None
    t = tool_request_from({"tools": [WEATHER, TIME]})
    assert t.choice == "auto" and t.parallel and [f.name for f in t.tools] == ["get_weather", "get_time"]
    named = tool_request_from({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_weather"}}})
    assert named.choice == "get_weather" and named.forced
    for body, field in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "retrieval"}]}, "tools"), ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
                        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice")]:
        with pytest.raises(InvalidTools) as err:
            tool_request_from(body)
        assert err.value.field == field


def test_parse_hermes_and_llama3_calls() -> None:
    content, calls = parse_calls("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "oslo", "days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", '
                                 '"arguments": {"zone": "utc"}}</tool_call>')
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "oslo", "days": 2}),
                                                                  ("get_time", {"zone": "utc"})]
    assert len({c.id for c in calls}) == 2
    assert parse_calls("hermes", "no call here") == ("no call here", [])
    assert parse_calls("hermes", "<tool_call>{broken</tool_call>")[1] == []
    content, calls = parse_calls("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "rome", "days": 1}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_calls("llama3", "The answer is 4.") == ("The answer is 4.", [])


def test_format_from_the_template() -> None:
    assert format_for("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert format_for("auto", "<|python_tag|>{{ tools }}") == "llama3"
    assert format_for("llama3", "<tool_call>") == "llama3"


def streamed(stream: ToolCallStream, text: str, chunk: int) -> tuple[str, list[list[str]], list[dict]]:
    """(content, [[id, name, arguments]], every tool-call delta) of `text` fed in pieces of `chunk`."""
    deltas = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)] + [stream.finish()]
    content, calls, raw = "", {}, []
    for d in deltas:
        content += d.content
        for t in d.tool_calls:
            raw.append(t)
            entry = calls.setdefault(t["index"], ["", "", ""])
            entry[0] += t.get("id", "")
            entry[1] += t.get("function", {}).get("name", "")
            entry[2] += t["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], raw


CALL_OUTPUTS = [
    ({"tools": [WEATHER, TIME]}, "hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"oslo", "days": 3}}\n</tool_call>\n<tool_call>{"arguments":{"zone":"utc"},"name":"get_time"}</tool_call>'),
    ({"tools": [WEATHER]}, "hermes", "a <tool_ lookalike but no call"),
    ({"tools": [WEATHER, TIME]}, "llama3", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; '
     '{"name": "get_weather", "parameters": {"city": "rome", "days": 1}}'),
    ({"tools": [WEATHER]}, "llama3", "The answer is 4."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "hermes",
     '{"city": "bergen", "days": 7}'),
    ({"tools": [WEATHER, TIME], "tool_choice": "required"}, "hermes",
     '[{"name": "get_time", "parameters": {"zone": "utc"}}, {"name": "get_weather", "parameters": '
     '{"city": "x", "days": 2}}]'),
]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(CALL_OUTPUTS)))
def test_streamed_calls_are_deltas_that_add_up_to_the_whole_answer(chunk: int, case: int) -> None:
    body, fmt, text = CALL_OUTPUTS[case]
    tools = tool_request_from(body)
    content, calls, raw = streamed(ToolCallStream(tools, fmt), text, chunk)
    want_content, want_calls = final_message(tools, fmt, text)
    assert content == (want_content or "")
    assert [c[1:] for c in calls] == [[c.name, c.arguments] for c in want_calls]
    for call in calls:
        assert call[0].startswith("call_") and call[2] and json.loads(call[2])
    firsts = {}
    for t in raw:  # each call's first delta names it (with its id and type); later ones only add arguments
        if t["index"] not in firsts:
            firsts[t["index"]] = t
            assert t["type"] == "function" and t["function"]["name"] and t["id"]
        else:
            assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
    if chunk == 1 and want_calls:
        assert len(raw) > 2 * len(want_calls)  # arguments arrive in pieces, not whole at the end


def test_the_text_before_a_call_streams_before_the_call_ends() -> None:
    stream = ToolCallStream(tool_request_from({"tools": [WEATHER]}), "hermes")
    assert stream.feed("Let me check.").content == "Let me check."
    assert stream.feed("\n<tool_").content == ""
    first = stream.feed('call>{"name": "get_weather", "arguments": {"ci')
    assert first.tool_calls == [{"index": 0, "id": stream.calls[0].id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert stream.feed('ty": "oslo"').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "oslo"'}}]


def test_tools_and_tool_results_render_back() -> None:
    tools = tool_request_from({"tools": [WEATHER]})
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    # A template without tools: the tools go in a system message, calls and results as text.
    out = messages_for_template(history, tools, "hermes", renders_tools=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "<tools>" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo", "days": 1}}' in out[2]["content"]
    assert out[3] == {"role": "tool", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"}
    # A template that renders tools gets them, and the calls' arguments as objects (the HF convention).
    tok = TextTokenizer(tiny_model_folder(0))
    tok.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>{{ c.function.name }}({{ c.function.arguments.city }})</tool_call>{% endfor %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    messages = messages_for_template(history, tools, "hermes", renders_tools=True)
    text = tok.apply_chat_template(messages, tools=[f.as_openai() for f in tools.tools])
    assert text == ("<tools>get_weather;</tools>[user]Weather in Oslo?[assistant]<tool_call>get_weather(oslo)"
                    "</tool_call>[tool]sunny, 21 C")


@pytest.mark.parametrize("choice", ["required", "get_time", "no_parallel"])
def test_forced_calls_are_always_valid_for_the_schema(choice: str) -> None:
    body = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    if choice == "get_time":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    if choice == "no_parallel":
        body["parallel_tool_calls"] = False
    tools = tool_request_from(body)
    tok = TextTokenizer(tiny_model_folder(0))
    eos = tok.token_id(EOS)
    sampler = FullSampler(2, 320, seed=0)
    sampler.grammar = GrammarSlots(GrammarCompiler(tok.tokenizer, 320, [eos]))
    params = SamplingParams(max_new_tokens=400, grammar=forced_call_grammar(tools))
    gen = torch.Generator().manual_seed(5)
    schemas = {f.name: f.parameters for f in tools.tools}
    close = ord("]")  # byte tokens: a push towards ']' ends the array of calls sooner
    for trial in range(5):
        sampler.reset_slot(0, params, [1])
        ids: list[int] = []
        while not ids or ids[-1] != eos:
            assert len(ids) < 400, tok.decode(ids)
            logits = torch.randn(1, 320, generator=gen) * 3
            logits[0, close] += 4.0
            token = int(sampler.sample(logits, SamplingBatch(torch.tensor([0]), [params], host_slots=[0])).tokens[0])
            sampler.commit(torch.tensor([0]), [[token]])
            ids.append(token)
        content, calls = final_message(tools, "hermes", tok.decode(ids[:-1]))
        assert content is None and calls, trial
        if choice == "no_parallel":
            assert len(calls) == 1
        for call in calls:
            assert choice in ("required", "no_parallel") or call.name == "get_time"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
