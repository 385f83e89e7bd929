"""The tools a chat request offers and how it lets the model use them (pure validation)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class InvalidTools(ValueError):
    """`tools`, `tool_choice` or `parallel_tool_calls` is malformed; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as the chat template sees it (the OpenAI shape, which HF templates read)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """tools: the functions offered; choice: "auto", "none", "required" or a function's name."""

    tools: list[Function] = field(default_factory=list)
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """required or a named function: the output is the call(s), under a grammar."""
        return self.choice not in ("auto", "none")

    @property
    def parses_output(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def function(self, name: str) -> Function:
        return next(f for f in self.tools if f.name == name)


def tool_request_from(body: dict[str, Any]) -> ToolRequest | None:
    """The tools of a chat body, or None when it offers none; raises InvalidTools."""
    raw_tools = body.get("tools")
    choice_raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidTools("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if raw_tools is None or raw_tools == []:
        if choice_raw not in (None, "none", "auto"):
            raise InvalidTools("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(raw_tools, list):
        raise InvalidTools("tools", "'tools' must be an array of function tools")
    tools = [_function(t, i) for i, t in enumerate(raw_tools)]
    names = [f.name for f in tools]
    if len(set(names)) != len(names):
        raise InvalidTools("tools", "'tools' has two functions of the same name")
    return ToolRequest(tools, _choice(choice_raw, names), True if parallel is None else parallel)


def _function(tool: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidTools("tools", f"'{where}' must be {{'type': 'function', 'function': {{...}}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidTools("tools", f"'{where}.function.name' must be a non-empty string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise InvalidTools("tools", f"'{where}.function.parameters' must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidTools("tools", f"'{where}.function.description' must be a string")
    return Function(name, description, params)


def _choice(raw: Any, names: list[str]) -> str:
    if raw is None:
        return "auto"
    if raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in names:
            raise InvalidTools("tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools'")
        return name
    raise InvalidTools("tool_choice", "'tool_choice' must be auto, none, required or "
                       "{'type': 'function', 'function': {'name': ...}}; got " + json.dumps(raw)[:100])
