"""Tool calls read out of JSON text that may still be growing (a stream), and out of whole text.

A call is an object with a "name" and its arguments under "arguments" or "parameters"; the
arguments are kept as the model wrote them (their raw JSON text, as OpenAI returns them), so
the fragments a stream sends add up to exactly what the whole answer holds. Scanning stops
where the text stops: a call's name is known once its string is closed, its arguments grow
with the text until their value closes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_DELIMITERS = ",}] \t\r\n"


class NotACall(ValueError):
    """The text cannot be (the start of) a call object."""


@dataclass
class ScannedCall:
    """What is known so far of one call: `arguments` is a prefix of its final text."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the object is closed: `arguments` is final ("{}" when it had none)


def skip_space(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in also):
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at text[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if it is not complete yet."""
    if text[i] == '"':
        return string_end(text, i)
    if text[i] not in "{[":
        j = i
        while j < len(text) and text[j] not in _DELIMITERS:
            j += 1
        return j if j < len(text) else None  # a number may still grow
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def scan_object(text: str, i: int) -> tuple[ScannedCall, int | None]:
    """The call object starting at text[i] (after spaces) and where it ends (None: not yet)."""
    i = skip_space(text, i)
    call = ScannedCall()
    if i >= len(text):
        return call, None
    if text[i] != "{":
        raise NotACall(f"a call starts with '{{', not {text[i]!r}")
    i += 1
    while True:
        i = skip_space(text, i, also=",")
        if i >= len(text):
            return call, None
        if text[i] == "}":
            call.complete = True
            call.arguments = call.arguments or "{}"
            return call, i + 1
        if text[i] != '"':
            raise NotACall(f"a key expected, got {text[i]!r}")
        key_end = string_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = skip_space(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise NotACall(f"':' expected after key {key!r}")
        i = skip_space(text, i + 1)
        if i >= len(text):
            return call, None
        end = value_end(text, i)
        if key == "name":
            if end is None:
                return call, None
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise NotACall("a call's name must be a string")
            call.name = name
        elif key in ARGUMENT_KEYS and not call.arguments:
            if text[i] == '"':  # arguments written as a JSON string: its text, once it is whole
                if end is None:
                    return call, None
                call.arguments = json.loads(text[i:end])
            else:
                call.arguments = text[i:len(text) if end is None else end]
        if end is None:
            return call, None
        i = end


def scan_calls(text: str, i: int = 0, array: bool = False) -> list[ScannedCall]:
    """The calls of `text` from `i`: objects one after another (separated by spaces, ';' or ','),
    or, with `array`, the objects of a JSON array. Stops at the first that is not complete."""
    calls: list[ScannedCall] = []
    i = skip_space(text, i)
    if array:
        if i >= len(text):
            return calls
        if text[i] != "[":
            raise NotACall("an array of calls starts with '['")
        i += 1
    while True:
        i = skip_space(text, i, also=";,")
        if i >= len(text) or (array and text[i] == "]"):
            return calls
        call, end = scan_object(text, i)
        calls.append(call)
        if end is None:
            return calls
        i = end
