"""Which request fields the HTTP API knows, so that none is silently ignored.

Every top-level field of a /v1/completions or /v1/chat/completions body is in one of three sets:
- implemented: it changes what the engine does (parsed in openai_protocol);
- ignored on purpose: bookkeeping that cannot change the output (`user`, `metadata`, ...),
  listed in the README's API section;
- anything else gets a 400 naming the field.
A known field whose value the engine cannot honour (`suffix`, `best_of` != n, audio output) is
refused by `check_unsupported_values` with a message saying why. A null value means "not set".
"""

from __future__ import annotations

from typing import Any

SHARED = frozenset({
    "model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "logit_bias", "seed", "stop", "logprobs",
    # vLLM / SGLang sampling extensions
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "return_token_ids",
    "max_completion_tokens",
    # structured outputs: OpenAI's, then vLLM's and SGLang's names (engine/grammar/spec.py)
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex",
    "ebnf",
    # disaggregation: set by the router
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_signature",
})
COMPLETION = SHARED | {"prompt", "echo", "best_of", "suffix"}
CHAT = SHARED | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "modalities",
                 "functions", "function_call", "audio", "prediction", "web_search_options", "reasoning_effort",
                 "verbosity", "moderation"}

# Accepted and ignored on purpose: none of these can change the tokens generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                     "prompt_cache_options", "prompt_cache_retention"})


class UnknownField(ValueError):
    """A field the API does not implement; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_fields(body: dict[str, Any], kind: str) -> None:
    """Raises UnknownField for the first field of `body` the endpoint does not know."""
    known = (CHAT if kind == "chat" else COMPLETION) | IGNORED
    for name in body:
        if name not in known:
            endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            raise UnknownField(name, f"'{name}' is not supported by {endpoint} on this server")
    check_unsupported_values(body, kind)


def check_unsupported_values(body: dict[str, Any], kind: str) -> None:
    """Known fields whose given value the engine cannot honour are refused, not dropped."""
    def given(name: str) -> bool:
        return body.get(name) is not None

    if kind == "completion":
        if given("suffix") and body["suffix"] != "":
            raise UnknownField("suffix", "'suffix' (insertion) is not supported: this server only appends")
        if given("best_of") and body["best_of"] != body.get("n", 1):
            raise UnknownField("best_of", "'best_of' other than n is not supported (no server-side ranking)")
        return
    if given("modalities") and body["modalities"] != ["text"]:
        raise UnknownField("modalities", "only the 'text' output modality is supported")
    for name, why in (("audio", "audio output is not supported"),
                      ("prediction", "predicted outputs are not supported"),
                      ("web_search_options", "web search is not supported"),
                      ("reasoning_effort", "this server has no reasoning-effort control"),
                      ("verbosity", "this server has no verbosity control"),
                      ("moderation", "moderation is not supported"),
                      ("functions", "the deprecated 'functions' is not supported: send 'tools'"),
                      ("function_call", "the deprecated 'function_call' is not supported: send 'tool_choice'")):
        if given(name):
            raise UnknownField(name, f"'{name}': {why}")
