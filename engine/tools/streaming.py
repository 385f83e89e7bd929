"""Tool calls in a stream: text flows until a call may start, the rest is held and, at the end,
read as calls (sent as tool_calls deltas) or let out as text."""

from __future__ import annotations

from splitserve.engine.tools.forcing import forced_calls
from splitserve.engine.tools.formats import ToolCall, call_may_start, new_call, parse_calls
from splitserve.engine.tools.request import ToolRequest


class ToolCallStream:
    """One choice's text, split into what can be streamed now and the calls found at the end."""

    def __init__(self, tools: ToolRequest, fmt: str) -> None:
        self.tools, self.fmt = tools, fmt
        self.text = ""  # everything so far
        self.sent = 0  # how much of it went out as content

    def feed(self, delta: str) -> str:
        """The part of the output so far that is surely not a call."""
        self.text += delta
        if self.tools.forced:
            return ""
        hold = call_may_start(self.fmt, self.text[self.sent:])
        end = len(self.text) if hold is None else self.sent + hold
        while end > self.sent and self.text[end - 1].isspace():  # it may lead into a call: held too
            end -= 1
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, the calls) once the output is complete."""
        content, calls = final_message(self.tools, self.fmt, self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        # Calls found: the held text was the calls (and what a hermes model wrote around them).
        sent = self.text[: self.sent]
        rest = content[len(sent):] if content and content.startswith(sent) else ""
        return rest, calls


def final_message(tools: ToolRequest, fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a complete output."""
    if tools.forced:
        found = forced_calls(tools, text)
        if found is None:
            return text, []
        return None, [new_call(name, args) for name, args in found]
    return parse_calls(fmt, text)
