"""tool_choice required or named, enforced with a grammar (as vLLM does): the output is JSON that
is the call, so it is always valid for the function's schema, whatever the chat template."""

from __future__ import annotations

import json
from typing import Any

from splitserve.api.tools.call_scanner import scan_calls
from splitserve.api.tools.request import ToolRequest
from splitserve.engine.grammar.spec import GrammarSpec

MAX_PARALLEL_CALLS = 16  # calls in one forced answer: a weak model may otherwise list calls forever


def forced_call_grammar(tools: ToolRequest) -> GrammarSpec:
    """Named: the arguments object. Required: an array of {"name", "parameters"} calls, one of
    them unless parallel calls are allowed."""
    if tools.choice != "required":
        return GrammarSpec("json_schema", json.dumps(tools.function(tools.choice).parameters, sort_keys=True),
                           "tool_choice")
    calls: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                             "required": ["name", "parameters"], "additionalProperties": False}
                            for f in tools.tools]},
    }
    calls["maxItems"] = MAX_PARALLEL_CALLS if tools.parallel else 1
    return GrammarSpec("json_schema", json.dumps(calls, sort_keys=True), "tool_choice")


def forced_calls(tools: ToolRequest, text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a forced output, or None if it is not complete JSON
    (cut by max_tokens)."""
    try:
        json.loads(text)  # complete (not cut by max_tokens)
    except json.JSONDecodeError:
        return None
    if tools.choice != "required":
        return [(tools.choice, text.strip())]
    return [(c.name, c.arguments) for c in scan_calls(text, array=True)]  # arguments as written
