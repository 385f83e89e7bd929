"""One streamed completion as the load generator sees it: an HTTP/1.1 POST of /v1/completions with
``stream: true``, its SSE events read as they arrive, timed when the socket delivers them.

The reader is an asyncio protocol over httptools' C parser (the one uvicorn uses): a socket read
goes straight to the parser, its body callbacks split SSE events and time them with the read's own
clock reading. httpx's pure-Python stack (httpcore, h11, anyio) spent ~230 us of client CPU per
event at 256 streams, most of it in per-read pause/resume and a connection pool scanned on every
close; at ~9,000 events/s that is more than one core, so the client, not the server, set the
measured figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

PHASES_COMMENT = b": phases "  # router/phases.py's SSE comment (not imported: the client stays light)


@dataclass
class RequestTiming:
    """What the client saw of one request (seconds; `itls` per token, between events)."""

    ttft: float
    itls: list[float]
    latency: float
    output_tokens: int
    ok: bool
    error: str = ""
    events: int = 0  # SSE data events received
    reads: int = 0  # socket reads they came in
    sent_at: float = 0.0  # time.perf_counter() when the request went out (system-wide on Linux)
    phases: dict[str, float] | None = None  # the router's split of its TTFT, when asked for (router/phases.py)


def completion_body(model: str, prompt: list[int], output_len: int) -> bytes:
    """The request body: greedy, `output_len` tokens exactly, token ids in every chunk."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True},
                      separators=(",", ":")).encode()


def http_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one HTTP/1.1 POST of a JSON body (and `headers`); the server closes the connection after
    it."""
    host = urlsplit(url).netloc
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


class StreamedCompletion(asyncio.Protocol):
    """Sends one request, parses the response as it arrives, and resolves `done` with its timing."""

    def __init__(self, request: bytes, output_len: int, start: float) -> None:
        self.request = request
        self.output_len = output_len
        self.start = start
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[RequestTiming] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.pending = b""  # body bytes after the last complete SSE event
        self.error_body = b""
        self.now = start
        self.first: float | None = None
        self.last = start
        self.itls: list[float] = []
        self.tokens = 0
        self.events = 0
        self.reads = 0
        self.phases: dict[str, float] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()  # every event in this read arrived now
        self.reads += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail("the server upgraded the connection")
        except httptools.HttpParserError as exc:
            self.fail(f"bad HTTP response: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(f"the connection closed after {self.tokens} tokens" + (f": {exc!r}" if exc else ""))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        events = (self.pending + body).split(b"\n\n")
        self.pending = events.pop()
        for event in events:
            if event.startswith(b"data: {"):
                self.on_event(event[6:])
            elif event.startswith(PHASES_COMMENT):
                self.phases = json.loads(event[len(PHASES_COMMENT):]).get("phases")
            if self.done.done():
                return

    def on_message_complete(self) -> None:
        if self.status != 200:
            self.fail(f"HTTP {self.status}: {self.error_body.decode(errors='replace')[:200]}")
        elif self.tokens != self.output_len:
            self.fail(f"the stream ended after {self.tokens} of {self.output_len} tokens")
        else:
            self.finish(True, "")

    # the request's outcome
    def on_event(self, payload: bytes) -> None:
        self.events += 1
        chunk = json.loads(payload)
        if "error" in chunk:
            self.fail(str(chunk["error"].get("message", chunk["error"])))
            return
        n = len(chunk["choices"][0].get("token_ids", ()))
        if not n:
            return
        if self.first is None:
            self.first = self.now
        else:
            self.itls.append((self.now - self.last) / n)
        self.last = self.now
        self.tokens += n

    def fail(self, error: str) -> None:
        self.finish(False, error)

    def finish(self, ok: bool, error: str) -> None:
        if self.done.done():
            return
        end = self.now  # the read that completed the response
        timing = (RequestTiming((self.first or end) - self.start, self.itls, end - self.start, self.tokens, True,
                                events=self.events, reads=self.reads, sent_at=self.start, phases=self.phases) if ok else
                  RequestTiming(0, [], 0, self.tokens, False, error, self.events, self.reads, self.start))
        self.done.set_result(timing)
        if self.transport is not None:
            self.transport.close()


async def stream_completion(url: str, request: bytes, output_len: int, timeout_s: float = 3600) -> RequestTiming:
    """One request (bytes from `http_post`) over a connection of its own, timed from the connect."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    protocol: StreamedCompletion | None = None

    def make() -> StreamedCompletion:
        nonlocal protocol
        protocol = StreamedCompletion(request, output_len, start)
        return protocol

    try:
        async with asyncio.timeout(timeout_s):
            await loop.create_connection(make, parts.hostname, parts.port or 80)
            assert protocol is not None
            return await protocol.done
    except (OSError, TimeoutError) as exc:
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
        tokens = protocol.tokens if protocol is not None else 0
        return RequestTiming(0, [], 0, tokens, False, f"{type(exc).__name__}: {exc}"[:200], sent_at=start)
