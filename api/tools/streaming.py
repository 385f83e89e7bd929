"""Tool calls in a stream, sent as OpenAI sends them: the text before a call streams as content;
a call's first delta carries its index, id, type and function name, the next ones fragments of
its arguments, as the model writes them. The fragments add up to the whole answer's calls
(arguments are kept as written: api/tools/call_scanner.py).

After each piece of output the stream works out what is known from all the text so far (the
content that is surely no call, the calls begun) and sends what grew since. At the end the
whole answer's reading (final_message) decides: what is still missing of it goes out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.api.tools.call_scanner import NotACall, ScannedCall, scan_calls
from splitserve.api.tools.forcing import forced_calls
from splitserve.api.tools.formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    ToolCall,
    call_may_start,
    new_call,
    parse_calls,
)
from splitserve.api.tools.request import ToolRequest


@dataclass
class ToolDelta:
    """What one chunk of a chat stream adds: content text and tool-call deltas (OpenAI's shape)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""  # sent so far


class ToolCallStream:
    """One choice's output, turned into content and tool-call deltas as it grows."""

    def __init__(self, tools: ToolRequest, fmt: str) -> None:
        self.tools, self.fmt = tools, fmt
        self.text = ""  # everything so far
        self.content = ""  # content sent so far
        self.calls: list[_SentCall] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> ToolDelta:
        """The content and call fragments that the output so far adds to what was sent."""
        self.text += delta
        try:
            content, calls = self._so_far()
        except NotACall:  # not a call after all: the end decides what it was
            return ToolDelta()
        return self._send(content, [(c.name, c.arguments) for c in calls if c.name is not None])

    def finish(self) -> ToolDelta:
        """What is still missing of the whole answer's content and calls, once the output is complete."""
        content, calls = final_message(self.tools, self.fmt, self.text)
        return self._send(content or "", [(c.name, c.arguments) for c in calls], ids=[c.id for c in calls])

    def _send(self, content: str, calls: list[tuple[str, str]], ids: list[str] | None = None) -> ToolDelta:
        out = ToolDelta()
        if content.startswith(self.content):
            out.content, self.content = content[len(self.content):], content
        for i, (name, arguments) in enumerate(calls):
            if i == len(self.calls):
                sent = _SentCall(ids[i] if ids else new_call(name, "").id, name)
                self.calls.append(sent)
                out.tool_calls.append({"index": i, "id": sent.id, "type": "function",
                                       "function": {"name": name, "arguments": ""}})
            sent = self.calls[i]
            if arguments.startswith(sent.arguments) and len(arguments) > len(sent.arguments):
                fragment, sent.arguments = arguments[len(sent.arguments):], arguments
                if out.tool_calls and out.tool_calls[-1]["index"] == i:
                    out.tool_calls[-1]["function"]["arguments"] += fragment
                else:
                    out.tool_calls.append({"index": i, "function": {"arguments": fragment}})
        return out

    def _so_far(self) -> tuple[str, list[ScannedCall]]:
        """(content that is surely no call, the calls begun) of the output so far."""
        text = self.text
        if self.tools.forced:
            if self.tools.choice == "required":
                return "", scan_calls(text, array=True)
            arguments = text.strip()  # a named function: the output is its arguments
            return "", [ScannedCall(self.tools.choice, arguments)] if arguments else []
        if self.fmt == "hermes":
            return _hermes_so_far(text)
        lead = text.lstrip()
        if lead.startswith(PYTHON_TAG) or lead.startswith("{"):
            return "", scan_calls(lead.removeprefix(PYTHON_TAG))
        if PYTHON_TAG.startswith(lead):
            return "", []  # may become the tag: held
        return text.rstrip(), []


def _hermes_so_far(text: str) -> tuple[str, list[ScannedCall]]:
    """Content outside <tool_call> tags (as the whole answer keeps it, less trailing space and a
    tag that may be starting: they may still lead into a call) and the calls inside them."""
    outside, calls, at = [], [], 0
    while True:
        start = text.find(HERMES_OPEN, at)
        if start < 0:
            tail = text[at:]
            hold = call_may_start("hermes", tail)
            outside.append(tail if hold is None else tail[:hold])
            break
        outside.append(text[at:start])
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        calls.extend(scan_calls(body)[:1])
        if end < 0:
            break
        at = end + len(HERMES_CLOSE)
    return "".join(outside).rstrip(), calls


def final_message(tools: ToolRequest, fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete output."""
    if tools.forced:
        found = forced_calls(tools, text)
        if found is None:
            return text, []
        return None, [new_call(name, args) for name, args in found]
    return parse_calls(fmt, text)
