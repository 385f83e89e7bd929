"""OpenAI-compatible request parsing and response shapes, as pure functions.

Every way a body can be wrong raises `ApiError` with the HTTP status, a message naming the
field, and the OpenAI error type, so the server answers a clear 4xx and keeps serving.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from splitserve.api.api_fields import UnknownField, check_fields
from splitserve.api.tools.forcing import forced_call_grammar
from splitserve.api.tools.request import InvalidTools, ToolRequest, tool_request_from
from splitserve.engine.grammar.spec import InvalidGrammarField, grammar_spec_from
from splitserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from splitserve.transfer.bootstrap_grant import SIGNATURE_FIELD

MAX_N = 16
MAX_STOP_STRINGS = 16
# Internal (router to engine): a streamed request with this field true gets the SSE comment FIRST_TOKEN_EVENT just
# before its first token's chunk, whatever that chunk's text (a first token may decode to none: part of a UTF-8
# character, a special token), so the router knows the stream has started. The router never relays it.
FIRST_TOKEN_FIELD = "first_token_event"
FIRST_TOKEN_EVENT = b": first_token\n\n"


CACHED_TOKENS_MARK = "cached_tokens"  # beside the stamps in a first-token event: the prompt tokens the cache held


def first_token_marker(marks: dict[str, float] | None, cached_tokens: int | None = None) -> bytes:
    """FIRST_TOKEN_EVENT carrying the request's phase stamps (engine/phase_timing.py), for the router's
    attribution of its TTFT, and the prompt tokens its prefix cache held, for the router's count of what its
    cache-aware choices got: ``: first_token {"taken": ..., ..., "cached_tokens": 96}``."""
    payload = {**(marks or {}), **({CACHED_TOKENS_MARK: cached_tokens} if cached_tokens is not None else {})}
    if not payload:
        return FIRST_TOKEN_EVENT
    return b": first_token " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def first_token_marks(event: bytes) -> tuple[dict[str, float] | None, int | None]:
    """(the stamps, the cached prompt tokens) a first-token event carries (None: none, or not readable)."""
    payload = event.strip()[len(FIRST_TOKEN_EVENT.strip()):].strip()
    if not payload:
        return None, None
    try:
        marks = json.loads(payload)
    except ValueError:
        return None, None
    if not isinstance(marks, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in marks.values()):
        return None, None
    cached = marks.pop(CACHED_TOKENS_MARK, None)
    return marks or None, int(cached) if cached is not None and cached >= 0 else None


class ApiError(Exception):
    """An error the client caused; becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ImagePart:
    """One image content part: a URL to load, or (from the router, under encoder disaggregation) a
    reference to rows an encode engine ships: the image's hash, the encoder and the room."""

    where: str  # "messages[i].content[j]", for error messages
    url: str | None = None
    digest: str | None = None
    encoder_addr: str | None = None
    room: int | None = None
    grid: tuple[int, int, int] | None = None  # Qwen-VL: the image's patch grid (t, h, w), from its encoder


@dataclass
class GenerationRequest:
    """One parsed API call: its prompts (text or ids) and how to sample them."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    return_token_ids: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    # Disaggregation: where the prefill side's bootstrap server is and which room to meet in.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    images: list[ImagePart] = field(default_factory=list)  # chat: the image parts, in prompt order
    tools: ToolRequest | None = None  # chat: the tools offered and how they may be used
    bootstrap_signature: str | None = None  # the router's grant of the three (transfer/bootstrap_grant.py)
    # The client named max_tokens (or max_completion_tokens): a prompt plus it over the context is a 400;
    # the default instead shrinks to the context the prompt leaves.
    max_tokens_given: bool = False

    @property
    def has_bootstrap_fields(self) -> bool:
        return any(v is not None for v in (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room,
                                           self.bootstrap_signature))


# ---- field readers: each names the field it reads in its error -------------------------------

def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(f"'{name}' must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise ApiError(f"'{name}' must be {_kind_names(kinds)}, got {type(value).__name__}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    return float(_get(body, name, (int, float), default))


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _get(body, name, (int,), default)
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not value:
        raise ApiError(f"'{name}' must not be empty", name)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ApiError(f"'{name}' token ids must be integers, got {t!r}", name)
        if not 0 <= t < vocab_size:
            raise ApiError(f"'{name}' token id {t} is outside the vocabulary [0, {vocab_size})", name)
    return list(value)


def _prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    """A prompt may be a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(value, str):
        if not value:
            raise ApiError("'prompt' must not be empty", "prompt")
        return [value]
    if not isinstance(value, list) or not value:
        raise ApiError("'prompt' must be a non-empty string, array of strings, or array of token ids", "prompt")
    if all(isinstance(p, str) for p in value):
        if any(not p for p in value):
            raise ApiError("'prompt' must not contain empty strings", "prompt")
        return list(value)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        return [_token_ids(value, "prompt", vocab_size)]
    if all(isinstance(p, list) for p in value):
        return [_token_ids(p, "prompt", vocab_size) for p in value]
    raise ApiError("'prompt' mixes strings, token ids and arrays", "prompt")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        return [s for s in stop if s]
    raise ApiError("'stop' must be a string or an array of strings", "stop")


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    raw = _get(body, "logit_bias", (dict,), {})
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(f"'logit_bias' values must be numbers, got {value!r}", "logit_bias")
        bias[token] = float(value)
    return bias


def sampling_params_from(body: dict[str, Any], vocab_size: int, default_max_tokens: int,
                         logprobs: int | None) -> SamplingParams:
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", default_max_tokens)
    assert max_tokens is not None
    if max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    if stop_ids:
        stop_ids = _token_ids(stop_ids, "stop_token_ids", vocab_size)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", -1) or -1,  # 0 means off, as in vLLM
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        logit_bias=_logit_bias(body),
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=stop_ids,
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
        logprobs=logprobs,
        grammar=_grammar(body),
    )
    try:
        params.validate(vocab_size)
    except InvalidSamplingParams as exc:
        raise ApiError(str(exc), _param_of(str(exc))) from None
    return params


def _grammar(body: dict[str, Any]):
    try:
        return grammar_spec_from(body)
    except InvalidGrammarField as exc:
        raise ApiError(str(exc), exc.field) from None


def _param_of(message: str) -> str | None:
    head = message.split(" ", 1)[0]
    return "max_tokens" if head == "max_tokens" else head or None


def _max_tokens_given(body: dict[str, Any]) -> bool:
    return body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None


def _common(body: dict[str, Any], served_model: str) -> tuple[str, int, bool, bool]:
    model = _get(body, "model", (str,), served_model)
    if model != served_model:
        raise ApiError(f"model {model!r} does not exist; this server serves {served_model!r}", "model",
                       status=404, code="model_not_found")
    n = _int(body, "n", 1)
    assert n is not None
    if not 1 <= n <= MAX_N:
        raise ApiError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    stream = bool(_get(body, "stream", (bool,), False))
    opts = _get(body, "stream_options", (dict,), {})
    if opts and not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for key in opts:
        if key not in ("include_usage", "include_obfuscation"):  # obfuscation pads chunks: no output change
            raise ApiError(f"'stream_options.{key}' is not supported", "stream_options")
    include_usage = bool(opts.get("include_usage", False))
    return model, n, stream, include_usage


def _bootstrap(body: dict[str, Any], req: GenerationRequest) -> GenerationRequest:
    req.bootstrap_host = _get(body, "bootstrap_host", (str,), None)
    req.bootstrap_port = _int(body, "bootstrap_port", None)
    room = _int(body, "bootstrap_room", None)
    if room is not None and not 0 <= room < 2**63:
        raise ApiError(f"'bootstrap_room' must be in [0, 2^63), got {room}", "bootstrap_room")
    req.bootstrap_room = room
    req.bootstrap_signature = _get(body, SIGNATURE_FIELD, (str,), None)
    return req


def _check_fields(body: Any, kind: str) -> None:
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    try:
        check_fields(body, kind)
    except UnknownField as exc:
        raise ApiError(str(exc), exc.field) from None


def parse_completion(body: Any, served_model: str, vocab_size: int, default_max_tokens: int = 16
                     ) -> GenerationRequest:
    """Validates a /v1/completions body."""
    _check_fields(body, "completion")
    if "prompt" not in body:
        raise ApiError("'prompt' is required", "prompt")
    model, n, stream, include_usage = _common(body, served_model)
    prompts = _prompts(body["prompt"], vocab_size)
    logprobs = _int(body, "logprobs", None)
    params = sampling_params_from(body, vocab_size, default_max_tokens, logprobs)
    req = GenerationRequest(
        kind="completion", model=model, prompts=prompts, params=params, n=n, stream=stream,
        include_usage=include_usage, echo=bool(_get(body, "echo", (bool,), False)),
        return_token_ids=bool(_get(body, "return_token_ids", (bool,), False)),
        max_tokens_given=_max_tokens_given(body),
    )
    if req.echo and stream:
        raise ApiError("'echo' is not supported with 'stream'", "echo")
    return _bootstrap(body, req)


def parse_chat(body: Any, served_model: str, vocab_size: int, default_max_tokens: int,
               takes_images: bool = False) -> tuple[GenerationRequest, list[dict[str, Any]]]:
    """Validates a /v1/chat/completions body; returns the request and its messages (content parts
    kept as a list of text and `{"type": "image"}` parts when the model takes images)."""
    _check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array", "messages")
    messages = list(messages)
    images: list[ImagePart] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"'messages[{i}]' must be an object", "messages")
        if m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise ApiError(f"'messages[{i}].role' must be system, user, assistant, tool or developer, "
                           f"got {m.get('role')!r}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = [_content_part(part, f"messages[{i}].content[{j}]", images) for j, part in enumerate(content)]
            if takes_images:  # the template renders the parts (an image part becomes its placeholder)
                messages[i] = {**m, "content": parts}
            else:
                messages[i] = {**m, "content": "".join(p.get("text", "") for p in parts)}
        elif content is None and m.get("role") == "assistant" and m.get("tool_calls"):
            _check_tool_calls(m["tool_calls"], i)
        elif not isinstance(content, str):
            raise ApiError(f"'messages[{i}].content' must be a string or an array of content parts", "messages")
    if images and not takes_images:
        raise ApiError(f"{images[0].where}: this model takes no images (it is a text-only model)", images[0].where,
                       code="images_not_supported")
    model, n, stream, include_usage = _common(body, served_model)
    logprobs = None
    if _get(body, "logprobs", (bool,), False):
        logprobs = _int(body, "top_logprobs", 0)
    params = sampling_params_from(body, vocab_size, default_max_tokens, logprobs)
    tools = _tools(body)
    if tools is not None and tools.forced:
        if params.grammar is not None:
            raise ApiError(f"'{params.grammar.source_field}' cannot be combined with a forced tool call "
                           "(tool_choice required or a named function)", params.grammar.source_field)
        params.grammar = forced_call_grammar(tools)
    req = GenerationRequest(
        kind="chat", model=model, prompts=[], params=params, n=n, stream=stream, include_usage=include_usage,
        return_token_ids=bool(_get(body, "return_token_ids", (bool,), False)), images=images, tools=tools,
        max_tokens_given=_max_tokens_given(body),
    )
    return _bootstrap(body, req), messages


def _tools(body: dict[str, Any]) -> ToolRequest | None:
    try:
        return tool_request_from(body)
    except InvalidTools as exc:
        raise ApiError(str(exc), exc.field) from None


def _check_tool_calls(calls: Any, i: int) -> None:
    """An earlier assistant turn's calls, as the client echoes them back."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(f"'{where}' must be an array", "messages")
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ApiError(f"'{where}' entries need function.name and function.arguments strings", "messages")


def _content_part(part: Any, where: str, images: list[ImagePart]) -> dict[str, Any]:
    """A text part as is; an image part recorded in `images` and rendered as `{"type": "image"}`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ApiError(f"{where}: a text part needs a string 'text'", where)
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str) or not url:
            raise ApiError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}", where, code="invalid_image")
        images.append(ImagePart(where, url=url))
        return {"type": "image"}
    if kind == "image_ref":  # written by the router when an encode engine computes the rows
        ref = part.get("image_ref")
        if not isinstance(ref, dict) or not isinstance(ref.get("digest"), str) or len(ref["digest"]) != 64:
            raise ApiError(f"{where}: an image_ref part needs a 64-hex 'digest'", where)
        room, addr = ref.get("room"), ref.get("encoder_addr")
        if (room is None) != (addr is None) or (room is not None and not (
                isinstance(room, int) and not isinstance(room, bool) and 0 <= room < 2**63 and isinstance(addr, str))):
            raise ApiError(f"{where}: an image_ref names both 'encoder_addr' and a 'room' in [0, 2^63), or neither",
                           where)
        grid = ref.get("grid")
        if grid is not None and not (isinstance(grid, list) and len(grid) == 3 and all(
                isinstance(g, int) and not isinstance(g, bool) and 0 < g < 2**16 for g in grid)):
            raise ApiError(f"{where}: an image_ref's 'grid' is three positive integers (t, h, w)", where)
        images.append(ImagePart(where, digest=ref["digest"], encoder_addr=addr, room=room,
                                grid=tuple(grid) if grid is not None else None))
        return {"type": "image"}
    raise ApiError(f"{where}: content parts must be text or image_url parts, got {kind!r}", where)


# ---- response shapes ------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def samples_usage(prompts: dict[int, tuple[int, list[int]]], completion_tokens: int) -> dict[str, Any]:
    """Usage of an answer with n samples per prompt: prompt index -> (its length, its samples'
    cached tokens). Each prompt counts once, its cached tokens the fewest any sample found: samples
    after the first to arrive copy its pages, and which one arrives first (a router sends them as
    separate requests) is a race; the fewest is the same in every deployment."""
    return usage(sum(length for length, _ in prompts.values()), completion_tokens,
                 sum(min(cached) for _, cached in prompts.values()))


def completion_logprobs(tokens: list[str], logprobs: list[float],
                        top: list[list[tuple[str, float]]] | None) -> dict[str, Any]:
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [dict(t) for t in top] if top is not None else None,
            "text_offset": []}


def chat_logprobs(tokens: list[str], logprobs: list[float],
                  top: list[list[tuple[str, float]]] | None) -> dict[str, Any]:
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        entry: dict[str, Any] = {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
        entry["top_logprobs"] = [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                 for t, v in (top[i] if top is not None else [])]
        content.append(entry)
    return {"content": content}
