"""Calls to one engine, and what their failures mean for the router.

A failure has a kind that decides what happens next:
- ``unreachable``: connect/read error or timeout; the engine is ejected (unless it is the last healthy
  one of its role: then it is probed at once) and the request retried;
- ``server``: a 5xx the engine did not pin on the request; ejected and retried;
- ``busy``: 503 with Retry-After (the engine's queue is full); retried elsewhere, not ejected;
- ``request``: the engine is fine but this attempt failed (e.g. its KV transfer); retried;
- ``client``: a 4xx; the same request would fail anywhere, so it goes back to the client.

Connections to engines are pooled (``UpstreamClient``): an idle one is let go of before the engine's
own keep-alive timeout closes it, and a request whose pooled connection turns out dead before any
answer byte (the engine's close crossed it) is sent once more on a fresh connection before its
failure counts against the engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.api.openai_protocol import FIRST_TOKEN_EVENT
from splitserve.router.backend_pool import Backend
from splitserve.router.connection_pool import PooledTransport

logger = logging.getLogger(__name__)

FIRST_TOKEN_MARK = FIRST_TOKEN_EVENT.strip()

EJECTING_KINDS = ("unreachable", "server")
RETRYABLE_KINDS = ("unreachable", "server", "busy", "request")
REQUEST_ERROR_CODES = ("generation_failed",)  # engine-side codes that blame the request, not the engine


# What a request on a pooled keep-alive connection the engine has closed meets: a reset (ReadError,
# WriteError) or a closed socket ("Server disconnected without sending a response").
DEAD_CONNECTION_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class _ConnectionTrace:
    """httpcore's trace of one request: whether it opened a connection, and whether an answer began."""

    def __init__(self, outer: Any) -> None:
        self.outer, self.opened, self.answered = outer, False, False

    async def __call__(self, name: str, info: dict) -> None:
        if name.startswith("connection.connect_tcp."):
            self.opened = True
        elif name.endswith("receive_response_headers.complete"):
            self.answered = True
        if self.outer is not None:
            await self.outer(name, info)


class UpstreamClient(httpx.AsyncClient):
    """The router's client for engines. Idle connections stay pooled for ``keepalive_expiry_s``
    (below the engines' keep-alive timeout, so the router lets go of a connection before the engine
    closes it); a request that meets a dead pooled connection before any answer byte is sent once
    more on a fresh connection (``stale_retries`` counts them)."""

    def __init__(self, timeout: httpx.Timeout, keepalive_expiry_s: float, max_keepalive: int = 256) -> None:
        # Our pool, not httpx's: its work per request grows with the connections open (router/connection_pool.py).
        self.transport = PooledTransport(keepalive_expiry_s, max_keepalive)
        super().__init__(timeout=timeout, transport=self.transport)
        self.fresh = httpx.AsyncClient(timeout=timeout, transport=PooledTransport(None, 0))
        self.stale_retries = 0

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:  # type: ignore[override]
        outer = request.extensions.get("trace")
        trace = _ConnectionTrace(outer)
        request.extensions["trace"] = trace
        try:
            return await super().send(request, **kwargs)
        except DEAD_CONNECTION_ERRORS as exc:
            if trace.opened or trace.answered:  # a new connection that failed, or an answer cut short
                raise
            self.stale_retries += 1
            logger.info("%s %s: pooled connection dead (%s: %s); once more on a fresh one", request.method,
                        request.url, type(exc).__name__, exc)
        finally:
            if outer is None:
                request.extensions.pop("trace", None)
            else:
                request.extensions["trace"] = outer
        return await self.fresh.send(request, **kwargs)

    async def aclose(self) -> None:
        try:
            await self.fresh.aclose()
        finally:
            await super().aclose()


class UpstreamFailure(Exception):
    """One engine call that failed, with the kind of failure and the engine's answer."""

    def __init__(self, backend: Backend, kind: str, status: int, body: Any) -> None:
        super().__init__(f"{backend.role} {backend.url}: {kind} ({status or 'no answer'}): {_message_of(body)}")
        self.backend, self.kind, self.status, self.body = backend, kind, status, body


def _message_of(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)[:300]


def failure_of_status(backend: Backend, response: httpx.Response, body: bytes) -> UpstreamFailure:
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body[:500].decode(errors="replace")
    status = response.status_code
    if status < 500:
        kind = "client"
    elif status == 503 and "retry-after" in response.headers:
        kind = "busy"
    elif isinstance(parsed, dict) and (parsed.get("error") or {}).get("code") in REQUEST_ERROR_CODES:
        kind = "request"
    else:
        kind = "server"
    return UpstreamFailure(backend, kind, status, parsed)


def unreachable(backend: Backend, exc: BaseException) -> UpstreamFailure:
    return UpstreamFailure(backend, "unreachable", 0, f"{type(exc).__name__}: {exc}")


async def post_json(client: httpx.AsyncClient, backend: Backend, path: str, body: dict,
                    headers: dict[str, str] | None = None) -> bytes:
    """POSTs and reads the whole answer; raises UpstreamFailure unless it is a 200."""
    try:
        r = await client.post(f"{backend.url}{path}", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise unreachable(backend, exc) from exc
    if r.status_code != 200:
        raise failure_of_status(backend, r, r.content)
    return r.content


async def open_stream(client: httpx.AsyncClient, backend: Backend, path: str, body: dict,
                      headers: dict[str, str] | None = None) -> httpx.Response:
    """Opens a POST whose answer is read later; raises UpstreamFailure unless it is a 200."""
    try:
        r = await client.send(client.build_request("POST", f"{backend.url}{path}", json=body, headers=headers),
                              stream=True)
    except httpx.HTTPError as exc:
        raise unreachable(backend, exc) from exc
    if r.status_code != 200:
        try:
            content = await r.aread()
        except httpx.HTTPError:
            content = b""
        finally:
            await r.aclose()
        raise failure_of_status(backend, r, content)
    return r


async def sse_events(backend: Backend, response: httpx.Response) -> AsyncIterator[bytes]:
    """An SSE answer's events, whole (``data: ...\\n\\n``); a broken stream raises UpstreamFailure."""
    buffer = b""
    try:
        async for chunk in response.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield event + b"\n\n"
    except httpx.HTTPError as exc:
        raise unreachable(backend, exc) from exc
    if buffer.strip():
        yield buffer


@dataclass
class EventKind:
    """What one SSE event of an engine's stream carries."""

    token: bool  # text, token ids or a finish reason: the client has its first answer
    error: dict | None  # an error event
    done: bool  # the final [DONE]
    first_token: bool = False  # the engine's marker of its first token (FIRST_TOKEN_EVENT), not for the client


def event_kind(event: bytes) -> EventKind:
    data = event.strip()
    if data.startswith(FIRST_TOKEN_MARK) and data[len(FIRST_TOKEN_MARK):len(FIRST_TOKEN_MARK) + 1] in (b"", b" "):
        return EventKind(True, None, False, first_token=True)
    if data.startswith(b"data: "):
        data = data[6:]
    if data == b"[DONE]":
        return EventKind(False, None, True)
    try:
        payload = json.loads(data)
    except ValueError:
        return EventKind(False, None, False)
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return EventKind(False, payload, False)
    for choice in payload.get("choices") or [] if isinstance(payload, dict) else []:
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("token_ids") or delta.get("content") or choice.get("finish_reason"):
            return EventKind(True, None, False)
    return EventKind(False, None, False)


def sse_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """An OpenAI-style error event, for a stream that breaks after its first token."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
