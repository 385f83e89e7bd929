"""What a request constrains its output to, read from the API's field names (pure functions).

The OpenAI names: `response_format` {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": ...}}; the vLLM names: `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`; the SGLang names: `json_schema`, `regex`, `ebnf`. At most one may be given.
A json_schema is always enforced, whatever its `strict` says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]

# field -> the kind of grammar it gives
EXTENSION_FIELDS: dict[str, GrammarKind] = {
    "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "ebnf",
    "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
}


class InvalidGrammarField(ValueError):
    """A structured-output field is malformed or combined with another one; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on one request's output. `source`: the schema as JSON text, the regex, the
    EBNF (root rule `root`), or for a choice the EBNF of its alternatives."""

    kind: GrammarKind
    source: str
    source_field: str = field(default="response_format", compare=False)  # the request field it came from


def grammar_spec_from(body: dict[str, Any]) -> GrammarSpec | None:
    """The constraint a request body asks for, or None; raises InvalidGrammarField."""
    found: list[tuple[str, GrammarSpec]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name, kind in EXTENSION_FIELDS.items():
        value = body.get(name)
        if value is not None:
            spec = _extension(name, kind, value)
            found.append((name, GrammarSpec(spec.kind, spec.source, name)))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for n, _ in found)
        raise InvalidGrammarField(found[1][0], f"give one structured-output constraint, got {names}")
    return found[0][1] if found else None


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidGrammarField("response_format", "'response_format' must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", '{"type": "object"}')
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise InvalidGrammarField("response_format", "'response_format.json_schema' must be an object whose "
                                      "'schema' is a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(inner.get("schema", {}), sort_keys=True))
    raise InvalidGrammarField("response_format", f"'response_format.type' must be text, json_object or json_schema, "
                              f"got {kind!r}")


def _extension(name: str, kind: GrammarKind, value: Any) -> GrammarSpec:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidGrammarField(name, f"'{name}' is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidGrammarField(name, f"'{name}' must be a JSON schema object")
        return GrammarSpec("json_schema", json.dumps(value, sort_keys=True))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidGrammarField(name, f"'{name}' must be a non-empty array of non-empty strings")
        return GrammarSpec("choice", choice_ebnf(value))
    if not isinstance(value, str) or not value:
        raise InvalidGrammarField(name, f"'{name}' must be a non-empty string")
    return GrammarSpec(kind, value)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped.replace(chr(9), chr(92) + "t")}"'
