"""How models write tool calls, and how they are read back from the output.

hermes (Hermes, Qwen 2/2.5/3, SmolLM): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
llama3 (Llama 3.1+ JSON tool calling): the output is `{"name": ..., "parameters": {...}}`, optionally
after `<|python_tag|>`, several separated by `;`.
The format comes from --tool-call-parser, or from the chat template ("auto"). A template that does
not render tools itself gets them in a system message written for the format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.api.tools.call_scanner import scan_calls
from splitserve.api.tools.request import ToolRequest

FORMATS = ("hermes", "llama3")
PARSER_CHOICES = ("auto", *FORMATS)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}")


def format_for(parser: str, chat_template: str | None) -> str:
    """The tool-call format: the flag's, or the one the template writes."""
    if parser != "auto":
        return parser
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def parse_calls(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left outside the calls or None, the calls) of a model's output."""
    if fmt == "hermes":
        calls = []
        for body in _HERMES_CALL.findall(text):
            call = _json_call(body)
            if call is None:
                return text, []  # a malformed call: leave the text as content
            calls.append(call)
        content = _HERMES_CALL.sub("", text).rstrip() if calls else text  # as a stream sends it
        return (content or None) if calls else text, calls
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if not stripped.startswith("{"):
        return text, []
    calls = []
    for part in _split_json_objects(stripped):
        call = _json_call(part)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def call_may_start(fmt: str, text: str) -> int | None:
    """Where in streamed `text` a call starts or might start (hold the rest back), or None."""
    if fmt == "hermes":
        marker = "<tool_call>"
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker cut by the chunk boundary
            if marker.startswith(text[-k:]):
                return len(text) - k
        return None
    lead = text.lstrip()
    if not lead or lead.startswith("{") or PYTHON_TAG.startswith(lead[: len(PYTHON_TAG)]):
        return 0
    return None


def _json_call(text: str) -> ToolCall | None:
    """The call `text` holds (one JSON object), its arguments as written; None if it is none."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    scanned = scan_calls(text)[0]
    return new_call(value["name"], scanned.arguments)


def _split_json_objects(text: str) -> list[str]:
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return parts


def render_call(fmt: str, name: str, arguments: Any) -> str:
    """An earlier assistant call as the model would have written it (for templates without tools)."""
    args = arguments if not isinstance(arguments, str) else _loads_or_text(arguments)
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    return PYTHON_TAG + json.dumps({"name": name, "parameters": args})


def tools_system_prompt(fmt: str, tools: ToolRequest) -> str:
    listing = "\n".join(json.dumps(f.as_openai()) for f in tools.tools)
    if fmt == "hermes":
        return ("You can call functions. Their signatures, as JSON, are inside <tools></tools>:\n<tools>\n"
                f"{listing}\n</tools>\nTo call one, write a JSON object with its name and arguments between "
                '<tool_call></tool_call> tags:\n<tool_call>\n{"name": "<name>", "arguments": {...}}\n</tool_call>')
    return ("You can call functions. Their signatures, as JSON:\n"
            f"{listing}\nTo call one, answer only with a JSON object: "
            '{"name": "<name>", "parameters": {...}}')


def messages_for_template(messages: list[dict[str, Any]], tools: ToolRequest | None, fmt: str,
                          renders_tools: bool) -> list[dict[str, Any]]:
    """Messages as the template expects them: earlier calls' arguments as objects (the HF
    convention); for a template that renders no tools, the tools in a system message and earlier
    calls and results written out as text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if renders_tools:
            if calls:
                m = {**m, "content": m.get("content") or "", "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _loads_or_text(c["function"]["arguments"])}}
                    for c in calls]}
        elif calls:
            text = "\n".join(render_call(fmt, c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()}
        elif m.get("role") == "tool" and fmt == "hermes":
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content')}\n</tool_response>"}
        out.append(m)
    if tools is not None and tools.tools and not renders_tools:
        prompt = tools_system_prompt(fmt, tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content')}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
