"""The OpenAI-compatible HTTP API of one engine (Starlette on uvicorn).

Handlers are thin: parse and validate (openai_protocol), tokenize, run every choice through
the engine client concurrently, and shape the answer. A client that goes away aborts its
requests, streaming or not, so their KV pages come back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.api.chat_prompt import chat_prompt_text
from splitserve.api.core_protocol import CoreGone
from splitserve.api.engine_client import EngineClient
from splitserve.api.http_request import ROUTE_ERROR_HANDLERS, error_response, read_json, wait_for_disconnect
from splitserve.api.openai_protocol import (
    FIRST_TOKEN_FIELD,
    ApiError,
    GenerationRequest,
    chat_logprobs,
    completion_logprobs,
    first_token_marker,
    parse_chat,
    parse_completion,
    samples_usage,
)
from splitserve.api.role_endpoint import role_route
from splitserve.api.tools.formats import format_for
from splitserve.api.tools.streaming import ToolCallStream, final_message
from splitserve.engine.engine import EngineOverloaded
from splitserve.engine.grammar.compiler import InvalidGrammar
from splitserve.engine.multimodal.image_inputs import ImageInputConfig
from splitserve.engine.multimodal.image_items import EMBEDDING_TIMEOUT, ImageItem
from splitserve.engine.multimodal.prompt_images import (
    copies_for_choice,
    image_items,
    image_processor_for,
    place_images,
)
from splitserve.engine.request import FinishReason, TokenOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.bootstrap_grant import (
    KEY_HEADER,
    PROMPT_DIGEST_FIELD,
    PROMPT_FIELDS,
    PROMPT_IDS_FIELD,
    PROMPT_SIGNATURE_FIELD,
    SIGNATURE_FIELD,
    bootstrap_grant_valid,
    prompt_grant_valid,
)

if TYPE_CHECKING:
    from splitserve.api.core_client import CoreClient
    from splitserve.api.otel import Tracing

logger = logging.getLogger(__name__)
# The roles whose engines generate text for a completion request (a prefill and a decode switch between them).
COMPLETION_ROLES = ("unified", "prefill", "decode")


def core_gone_response(_request: HttpRequest, exc: Exception) -> Response:
    """Any endpoint that needs the engine core once it has died (a router's /internal/kv_events poll, ...): a 503
    saying why, not a 500 with a traceback in the log for every call (/health says it too)."""
    return error_response(ApiError(str(exc) or "the engine core process is gone", status=503, kind="server_error",
                                   code="engine_failed"))

class ChoiceResult:
    """Everything one choice produced, accumulated from its outputs."""

    def __init__(self, index: int, prompt_ids: list[int]) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.tool_stream: ToolCallStream | None = None  # streamed chat with tools: content and call deltas
        self.phase_marks: dict[str, float] | None = None  # where its time to first token went (phase_timing.py)

    def add(self, out: TokenOutput) -> None:
        if out.phase_marks is not None:
            self.phase_marks = out.phase_marks
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.top_logprobs:
            self.top += out.top_logprobs
        self.cached_tokens = out.cached_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value
            self.error = out.error


def check_bootstrap_grant(gen: GenerationRequest, key: str) -> None:
    """Bootstrap fields point this engine at a prefill's room: only the router, which holds the
    group's key, may do that (it signs them). Without a key this engine takes none at all: a
    client could otherwise make a decode connect anywhere and hold pages for made-up rooms."""
    if not gen.has_bootstrap_fields:
        return
    if not key:
        raise ApiError("this engine has no --transfer-control-key, so it takes no bootstrap fields "
                       "(splitserve up and the operator give every engine and the router the group's key)",
                       "bootstrap_room", status=403, kind="permission_error", code="bootstrap_not_granted")
    if gen.bootstrap_host is None or gen.bootstrap_port is None or gen.bootstrap_room is None:
        raise ApiError("bootstrap fields come as a set: 'bootstrap_host', 'bootstrap_port', 'bootstrap_room' "
                       f"and '{SIGNATURE_FIELD}'", "bootstrap_room", status=403, kind="permission_error",
                       code="bootstrap_not_granted")
    if not bootstrap_grant_valid(key, gen.bootstrap_host, gen.bootstrap_port, gen.bootstrap_room,
                                 gen.bootstrap_signature):
        raise ApiError(f"'{SIGNATURE_FIELD}' is missing or is not the router's grant of these bootstrap fields",
                       SIGNATURE_FIELD, status=403, kind="permission_error", code="bootstrap_not_granted")


INTERNAL_FIELDS = (*PROMPT_FIELDS, FIRST_TOKEN_FIELD)


def internal_fields(body: Any) -> dict[str, Any]:
    """Takes the router's internal fields out of a request body (the API's parsers do not know them)."""
    if not isinstance(body, dict):
        return {}
    return {name: body.pop(name) for name in INTERNAL_FIELDS if name in body}


def granted_prompt(internal: dict[str, Any], key: str) -> tuple[list[int], str] | None:
    """The router's token ids of the prompt and the digest of the tokenizer that made them, when the request
    carries them; a client cannot send them: ids without the router's signature under the group's key are a
    401 naming the field."""
    if not any(name in internal for name in PROMPT_FIELDS):
        return None
    if not key:
        raise ApiError(f"this engine has no --transfer-control-key, so it takes no '{PROMPT_IDS_FIELD}'",
                       PROMPT_IDS_FIELD, status=401, kind="authentication_error", code="prompt_not_granted")
    ids, digest = internal.get(PROMPT_IDS_FIELD), internal.get(PROMPT_DIGEST_FIELD)
    if not isinstance(ids, list) or not ids:
        raise ApiError(f"'{PROMPT_IDS_FIELD}' must be a non-empty array of token ids", PROMPT_IDS_FIELD)
    if not isinstance(digest, str):
        raise ApiError(f"'{PROMPT_DIGEST_FIELD}' must be a string", PROMPT_DIGEST_FIELD)
    if not prompt_grant_valid(key, digest, ids, internal.get(PROMPT_SIGNATURE_FIELD)):
        raise ApiError(f"'{PROMPT_SIGNATURE_FIELD}' is missing or is not the router's signature of "
                       f"'{PROMPT_IDS_FIELD}' and '{PROMPT_DIGEST_FIELD}'", PROMPT_SIGNATURE_FIELD, status=401,
                       kind="authentication_error", code="prompt_not_granted")
    return ids, digest


def load_anyio() -> None:
    """Loads the parts of anyio that starlette's responses use. anyio 4 imports its submodules on first use,
    and a server's first streamed response imported anyio.lowlevel and anyio._core's sockets, streams and testing
    modules inside the request (12-20 ms of a tiny model's 80-130 ms first request on a 2-core CPU, by
    PYTHONPROFILEIMPORTTIME): a cold first request that a warm-up of the engine cannot reach."""
    import anyio
    import anyio.lowlevel  # imported by anyio's event loop token on first use

    for name in dir(anyio):  # its lazy importer loads a name's module when the name is first read
        if not name.startswith("_"):
            getattr(anyio, name, None)


class ApiServer:
    """Builds the Starlette app around one engine, reached through its client: an `EngineClient`
    (the engine in this process) or a `CoreClient` (an engine core process)."""

    def __init__(self, client: EngineClient | CoreClient, images: ImageInputConfig | None = None,
                 control_key: str = "", tracing: Tracing | None = None) -> None:
        load_anyio()
        self.client = client
        self.tracing = tracing  # with --otel-endpoint: each request's phases here as spans (api/otel.py)
        self.control_key = control_key  # the group's transfer_control_key: bootstrap grants, /internal/*
        self.image_cfg = images or ImageInputConfig()
        self.vision = client.model_cfg.vision
        self.image_processor = (image_processor_for(self.vision, client.model_folder)
                                if self.vision is not None else None)
        self.model_name = client.model_name
        self.tokenizer = client.tokenizer
        self.vocab_size = client.model_cfg.vocab_size
        self.tool_format = format_for(client.tool_call_parser, self.tokenizer.chat_template)
        self._tokenizer_parts: dict[str, Any] | None = None  # /internal/tokenizer's answer, made on first use
        self._other_digests: set[str] = set()  # router tokenizers unlike ours, logged once each
        self.context_length = client.context_length
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/internal/state", self.internal_state, methods=["GET"]),
            Route("/internal/flush_cache", self.flush_cache, methods=["POST"]),
            Route("/internal/kv_events", self.kv_events, methods=["GET"]),
            Route("/internal/tokenizer", self.tokenizer_parts, methods=["GET"]),
            role_route(client, control_key, self._check_internal_key),
            *client.routes(),
        ], exception_handlers={ApiError: lambda _r, e: error_response(e), CoreGone: core_gone_response,
                               **ROUTE_ERROR_HANDLERS})

    # ---- endpoints ---------------------------------------------------------------------------

    def _check_generates_text(self) -> None:
        """An encoder (images to rows) and a drafter (drafts for its verifiers) answer no completion: a request
        sent there was sent to the wrong engine, which no retry here fixes."""
        role = self.client.role_name
        if role not in COMPLETION_ROLES:
            where = "/v1/encode, called by the router" if role == "encode" else "the draft mesh of its verifiers"
            raise ApiError(f"this {role} engine serves {where}, not completions; send text generation to "
                           "the router or to a unified, prefill or decode engine", status=404,
                           code="not_served_by_role")

    async def completions(self, request: HttpRequest) -> Response:
        self._check_generates_text()
        body = await read_json(request)
        internal = internal_fields(body)
        granted = granted_prompt(internal, self.control_key)
        gen = parse_completion(body, self.model_name, self.vocab_size)
        check_bootstrap_grant(gen, self.control_key)
        if granted is not None and len(gen.prompts) != 1:
            raise ApiError(f"'{PROMPT_IDS_FIELD}' is one prompt's ids; this request has {len(gen.prompts)} prompts",
                           PROMPT_IDS_FIELD)
        ids = self._granted_ids(granted)
        prompts = [ids] if ids is not None else [self._tokenize(p, add_special=True) for p in gen.prompts]
        return await self._respond(request, gen, prompts, first_token_event=internal.get(FIRST_TOKEN_FIELD) is True)

    async def chat_completions(self, request: HttpRequest) -> Response:
        self._check_generates_text()
        body = await read_json(request)
        internal = internal_fields(body)
        granted = granted_prompt(internal, self.control_key)
        gen, messages = parse_chat(body, self.model_name, self.vocab_size, default_max_tokens=256,
                                   takes_images=self.vision is not None)
        check_bootstrap_grant(gen, self.control_key)
        items: list[ImageItem] = []
        if gen.images and self.vision is not None:  # every image is checked before any engine work
            items = await image_items(gen.images, self.image_cfg, self.image_processor, self.vision,
                                      accept_refs=self.client.role_name != "unified")
        # A model that takes images renders content parts in its template (the router joins their text): such
        # a chat is templated here, as is one with images (the router cannot place their tokens).
        parts = self.vision is not None and any(isinstance(m.get("content"), list) for m in messages)
        ids = self._granted_ids(granted) if not gen.images and not parts else None
        if ids is None:
            text = chat_prompt_text(self.tokenizer, messages, gen.tools, self.tool_format)
            # The template already spells the special tokens (BOS, role markers) out.
            ids = self._tokenize(text, add_special=False)
            if self.vision is not None:
                ids = place_images(ids, items, self.vision)
        return await self._respond(request, gen, [self._tokenize(ids, add_special=False)], items,
                                   first_token_event=internal.get(FIRST_TOKEN_FIELD) is True)

    def prompt_digest(self) -> str:
        """What the router's `tokenizer_digest` must be for its ids to be ours: the tokenizer's digest (its
        vocabulary, special tokens and chat template) and the tool-call format (how tools are rendered)."""
        return f"{self._parts()['digest']}/{self.tool_format}"

    def _granted_ids(self, granted: tuple[list[int], str] | None) -> list[int] | None:
        """The router's ids of the prompt, when its tokenizer is ours; None to tokenize here (a rolling update
        with two tokenizer revisions: logged once per other digest)."""
        if granted is None:
            return None
        ids, digest = granted
        if digest == self.prompt_digest():
            return self._tokenize(ids, add_special=False)
        if digest not in self._other_digests:
            self._other_digests.add(digest)
            logger.warning("the router tokenized with tokenizer %s, this engine has %s: tokenizing here instead",
                           digest, self.prompt_digest())
        return None

    async def models(self, _request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "splitserve",
            "max_model_len": self.context_length}]})

    async def health(self, _request: HttpRequest) -> Response:
        ok, body = await self.client.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, _request: HttpRequest) -> Response:
        return Response(await self.client.metrics(), media_type=CONTENT_TYPE_LATEST)

    def _check_internal_key(self, request: HttpRequest) -> None:
        """/internal/* is for the group's own processes (and tests): with a key, they must show it."""
        if self.control_key and not hmac.compare_digest(request.headers.get(KEY_HEADER, ""), self.control_key):
            raise ApiError(f"missing or wrong {KEY_HEADER}", status=401, kind="authentication_error",
                           code="invalid_key")

    async def internal_state(self, request: HttpRequest) -> Response:
        self._check_internal_key(request)
        return JSONResponse(await self.client.internal_state())

    async def flush_cache(self, request: HttpRequest) -> Response:
        self._check_internal_key(request)
        return JSONResponse({"freed_pages": await self.client.flush_cache()})

    async def kv_events(self, request: HttpRequest) -> Response:
        """The page hashes this engine's prefix cache gained and evicted since `?epoch=E&seq=N` (a reset
        with every hash held now when those cannot be told as events): what cache-aware routers poll."""
        self._check_internal_key(request)
        try:
            seq = int(request.query_params.get("seq", "0"))
        except ValueError as exc:
            raise ApiError(f"seq must be an integer, got {request.query_params.get('seq')!r}") from exc
        return JSONResponse(await self.client.page_events(request.query_params.get("epoch"), seq))

    async def tokenizer_parts(self, request: HttpRequest) -> Response:
        """This engine's tokenizer, chat template and tool-call format, so that a router tokenizes as it does."""
        self._check_internal_key(request)
        return JSONResponse(self._parts())

    def _parts(self) -> dict[str, Any]:
        if self._tokenizer_parts is None:
            self._tokenizer_parts = {**self.tokenizer.parts(), "tool_format": self.tool_format}
        return self._tokenizer_parts

    # ---- shared machinery --------------------------------------------------------------------

    def _tokenize(self, prompt: str | list[int], add_special: bool) -> list[int]:
        try:
            ids = self.tokenizer.encode(prompt, add_special) if isinstance(prompt, str) else prompt
        except Exception as exc:  # the tokenizer library's own error: this prompt's fault
            raise ApiError(f"the prompt cannot be tokenized: {exc}", "prompt") from None
        if not ids:
            raise ApiError("the prompt encodes to no tokens", "prompt")
        if len(ids) > self.client.max_prompt_tokens:
            raise ApiError(f"the prompt has {len(ids)} tokens; this engine takes at most "
                           f"{self.client.max_prompt_tokens} (context {self.context_length}; the prompt and one "
                           "output token must fit in the context and in the KV cache)", "prompt",
                           code="context_length_exceeded")
        return ids

    def _fit_context(self, gen: GenerationRequest, ids: list[int]) -> SamplingParams:
        """The prompt's sampling parameters: a max_tokens the client named that does not fit in the context
        with the prompt is a 400 naming both (as vLLM words it); the default shrinks to the room left."""
        asked = gen.params.max_new_tokens
        if len(ids) + asked <= self.context_length:
            return gen.params
        if gen.max_tokens_given:
            what = "messages" if gen.kind == "chat" else "prompt"
            raise ApiError(f"This model's maximum context length is {self.context_length} tokens. However, you "
                           f"requested {len(ids) + asked} tokens ({len(ids)} in the {what}, {asked} in the "
                           f"completion). Please reduce the length of the {what} or completion.", "max_tokens",
                           code="context_length_exceeded")
        # _tokenize keeps a prompt to at most context - 1 tokens: there is room for one token at least.
        return dataclasses.replace(gen.params, max_new_tokens=self.context_length - len(ids))

    def _choice_streams(self, gen: GenerationRequest, prompts: list[list[int]], images: list[ImageItem]
                        ) -> list[tuple[ChoiceResult, AsyncIterator[TokenOutput]]]:
        streams = []
        bootstrap = (f"{gen.bootstrap_host}:{gen.bootstrap_port}"
                     if gen.bootstrap_host is not None and gen.bootstrap_port is not None else None)
        submitted: list[str] = []
        params = [self._fit_context(gen, ids) for ids in prompts]  # every prompt is checked before any runs
        try:
            for p, ids in enumerate(prompts):
                for j in range(gen.n):
                    index = p * gen.n + j
                    rid = gen.request_id if len(prompts) * gen.n == 1 else f"{gen.request_id}-{index}"
                    stream = self.client.generate(rid, ids, choice_params(params[p], j), bootstrap,
                                                  gen.bootstrap_room,
                                                  copies_for_choice(images))
                    submitted.append(rid)
                    streams.append((ChoiceResult(index, ids), stream))
        except EngineOverloaded as exc:
            for rid in submitted:  # all choices or none
                self.client.abort(rid, "another choice of the request was refused (engine overloaded)")
            raise ApiError(f"engine overloaded: {exc}; retry later", status=503, kind="server_error",
                           code="overloaded", headers={"Retry-After": str(exc.retry_after_s)}) from None
        return streams

    async def _compile_grammar(self, gen: GenerationRequest) -> None:
        """Compiles a structured-output constraint off the loop thread: a bad one is a 400 here, and
        the loop then finds it in the compiler's cache."""
        spec = gen.params.grammar
        if spec is None:
            return
        try:
            await self.client.compile_grammar(spec)
        except InvalidGrammar as exc:
            raise ApiError(str(exc), spec.source_field) from None

    async def _respond(self, request: HttpRequest, gen: GenerationRequest, prompts: list[list[int]],
                       images: list[ImageItem] | None = None, first_token_event: bool = False) -> Response:
        await self._compile_grammar(gen)
        streams = self._choice_streams(gen, prompts, images or [])
        spans = self.tracing.engine_sink(self.client.role_name, request.headers) if self.tracing is not None else None
        if gen.stream:
            return StreamingResponse(self._sse(gen, streams, first_token_event, spans), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        work = asyncio.ensure_future(self._collect(streams))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()  # the generators' finally blocks abort the requests
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        gone.cancel()
        choices = work.result()
        for c in choices if spans is not None else []:
            if c.phase_marks is not None:
                spans(c.phase_marks)
        failed = [c for c in choices if c.finish_reason == FinishReason.ERROR.value]
        if failed:
            message = failed[0].error or "generation failed"
            timed_out = message.startswith(EMBEDDING_TIMEOUT)  # image rows that never came from the encoder
            return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                           "code": "timeout" if timed_out else "generation_failed"}},
                                status_code=408 if timed_out else 503)
        if gen.has_bootstrap_fields and self.client.role_name == "prefill":
            # The router reads only the status of a prefill's answer (the decode answers the client): no
            # completion body is shaped (detokenized, parsed for tool calls) only to be thrown away.
            usage = _choices_usage(choices, gen.n)
            return JSONResponse({"prefilled": True, "prompt_tokens": usage["prompt_tokens"],
                                 "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "phase_marks": choices[0].phase_marks})
        return JSONResponse(self._final_body(gen, choices))

    async def _collect(self, streams) -> list[ChoiceResult]:
        async def drain(choice: ChoiceResult, stream: AsyncIterator[TokenOutput]) -> ChoiceResult:
            async for out in stream:
                choice.add(out)
            return choice
        return list(await asyncio.gather(*(drain(c, s) for c, s in streams)))

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.token_str(tid)

    def _logprobs_block(self, gen: GenerationRequest, token_ids: list[int], lps: list[float],
                        top: list[list[tuple[int, float]]]) -> dict[str, Any] | None:
        if gen.params.logprobs is None:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        top_text = [[(self._token_text(t), v) for t, v in row] for row in top] if top else None
        shape = chat_logprobs if gen.kind == "chat" else completion_logprobs
        return shape(tokens, lps, top_text)

    def _final_body(self, gen: GenerationRequest, choices: list[ChoiceResult]) -> dict[str, Any]:
        out_choices = []
        for c in choices:
            entry: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                     "logprobs": self._logprobs_block(gen, c.token_ids, c.logprobs, c.top)}
            if gen.kind == "chat":
                entry["message"] = {"role": "assistant", "content": c.text}
                if gen.tools is not None and gen.tools.parses_output and c.finish_reason != "error":
                    content, calls = final_message(gen.tools, self.tool_format, c.text)
                    if calls:
                        entry["message"] = {"role": "assistant", "content": content,
                                            "tool_calls": [call.as_openai() for call in calls]}
                        entry["finish_reason"] = _tool_finish(gen, c.finish_reason)
            else:
                prefix = self.tokenizer.decode(c.prompt_ids) if gen.echo else ""
                entry["text"] = prefix + c.text
            if gen.return_token_ids:
                entry["prompt_token_ids"] = c.prompt_ids
                entry["token_ids"] = c.token_ids
            out_choices.append(entry)
        return {
            "id": ("chatcmpl-" if gen.kind == "chat" else "cmpl-") + gen.request_id,
            "object": "chat.completion" if gen.kind == "chat" else "text_completion",
            "created": gen.created, "model": gen.model, "choices": out_choices,
            "usage": _choices_usage(choices, gen.n),
        }

    async def _sse(self, gen: GenerationRequest, streams, first_token: bool = False,
                   spans: Callable[[dict[str, float]], None] | None = None) -> AsyncIterator[bytes]:
        if len(streams) == 1:  # one choice: read its stream here (no pump task, no second queue per token)
            tasks: list[asyncio.Future] = []
            choice, stream = streams[0]

            async def next_output() -> tuple[ChoiceResult, TokenOutput | None]:
                try:
                    return choice, await anext(stream)
                except StopAsyncIteration:
                    return choice, None
        else:
            merged: asyncio.Queue[tuple[ChoiceResult, TokenOutput | None]] = asyncio.Queue()

            async def pump(choice: ChoiceResult, stream: AsyncIterator[TokenOutput]) -> None:
                try:
                    async for out in stream:
                        await merged.put((choice, out))
                finally:
                    await stream.aclose()  # type: ignore[attr-defined]
                    await merged.put((choice, None))

            tasks = [asyncio.ensure_future(pump(c, s)) for c, s in streams]
            next_output = merged.get
        kind = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
        rid = ("chatcmpl-" if gen.kind == "chat" else "cmpl-") + gen.request_id
        try:
            if gen.kind == "chat":
                for c, _ in streams:
                    if gen.tools is not None and gen.tools.parses_output:
                        c.tool_stream = ToolCallStream(gen.tools, self.tool_format)
                    yield _sse_event({"id": rid, "object": kind, "created": gen.created, "model": gen.model,
                                      "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
            open_streams = len(streams)
            while open_streams:
                choice, out = await next_output()
                if out is None:
                    open_streams -= 1
                    continue
                choice.add(out)
                if spans is not None and out.phase_marks is not None:
                    spans(out.phase_marks)
                if first_token and (out.token_ids or out.finish_reason not in (None, FinishReason.ERROR)):
                    first_token = False  # the marker carries the stamps the router attributes TTFT with
                    yield first_token_marker(choice.phase_marks, choice.cached_tokens)
                if out.finish_reason == FinishReason.ERROR:
                    yield _sse_event({"error": {"message": out.error or "generation failed",
                                                "type": "server_error", "code": "generation_failed"}})
                    continue
                if not out.text and not out.token_ids and out.finish_reason is None:
                    continue
                yield _sse_event(self._chunk(gen, rid, kind, choice, out))
            if gen.include_usage:
                choices = [c for c, _ in streams]
                yield _sse_event({"id": rid, "object": kind, "created": gen.created, "model": gen.model,
                                  "choices": [], "usage": _choices_usage(choices, gen.n)})
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            if not tasks:
                await streams[0][1].aclose()  # aborts the request if the client left before its end

    def _chunk(self, gen: GenerationRequest, rid: str, kind: str, choice: ChoiceResult,
               out: TokenOutput) -> dict[str, Any]:
        finish = out.finish_reason.value if out.finish_reason is not None else None
        logprobs = self._logprobs_block(gen, out.token_ids, out.logprobs or [], out.top_logprobs or [])
        entry: dict[str, Any] = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish}
        if gen.kind == "chat" and choice.tool_stream is not None:
            entry["delta"] = self._tool_delta(gen, choice.tool_stream, out, entry)
        elif gen.kind == "chat":
            entry["delta"] = {"content": out.text} if out.text else {}
        else:
            entry["text"] = out.text
        if gen.return_token_ids:
            entry["token_ids"] = out.token_ids
            if len(choice.token_ids) == len(out.token_ids):
                entry["prompt_token_ids"] = choice.prompt_ids
        return {"id": rid, "object": kind, "created": gen.created, "model": gen.model, "choices": [entry]}


    def _tool_delta(self, gen: GenerationRequest, tools: ToolCallStream, out: TokenOutput,
                    entry: dict[str, Any]) -> dict[str, Any]:
        """A chat delta with the content that is surely no call and the tool-call deltas the
        output adds (api/tools/streaming.py); at the end, what is still missing."""
        step = tools.feed(out.text)
        if out.finish_reason is not None and out.finish_reason != FinishReason.ERROR:
            rest = tools.finish()
            step.content += rest.content
            step.tool_calls += rest.tool_calls
            if tools.made_calls:
                entry["finish_reason"] = _tool_finish(gen, entry["finish_reason"])
        delta: dict[str, Any] = {"content": step.content} if step.content else {}
        if step.tool_calls:
            delta["tool_calls"] = step.tool_calls
        return delta


def _tool_finish(gen: GenerationRequest, finish: str | None) -> str | None:
    """OpenAI's finish reason once calls were made: tool_calls, or stop for a named function."""
    if finish != "stop":
        return finish
    assert gen.tools is not None
    return "tool_calls" if gen.tools.choice in ("auto", "required") else "stop"


def _choices_usage(choices: list[ChoiceResult], n: int) -> dict[str, Any]:
    """Usage of choices that come n per prompt, in prompt order."""
    prompts = {i // n: (len(c.prompt_ids), [x.cached_tokens for x in choices[i:i + n]])
               for i, c in enumerate(choices) if i % n == 0}
    return samples_usage(prompts, sum(len(c.token_ids) for c in choices))


def _sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def choice_params(params: SamplingParams, sample: int) -> SamplingParams:
    """Sample j of a seeded request draws with seed + j: the n samples differ, each reproducible
    (the router's fan-out gives sample j the same seed)."""
    if params.seed is None or sample == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + sample)
