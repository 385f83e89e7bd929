"""The router's pool of HTTP/1.1 connections to its engines: constant work per request, however many are open.

httpx's default pool (httpcore's) matches every queued request against every connection it holds, checking each
connection's state, whenever a request starts or a response closes. A router holds one connection per stream in
flight, so with a few hundred streams open to a lone engine each request start or stream end costs hundreds of
checks, and a burst of them costs thousands each: in a profile of a 256-stream burst through the router (tiny
model, CPU), half of the router's event loop (50% of its samples) went to that pool, and the burst ran at
0.45-0.65x the speed of the same burst sent straight to the engine.

Here each origin keeps a stack of idle connections. A request takes the most recently used one that has neither
expired nor been closed by the engine (checked for that one connection alone), or opens a new one; a response,
once closed, hands its connection back if it can serve another request and the pool holds fewer than
`max_keepalive` idle ones, else closes it. Idle connections past their keep-alive expiry are closed as they
surface at the bottom of their stack, oldest first, so the pool lets go of them before the engine closes them.

`PooledTransport` is httpx's own transport (request conversion, exception mapping, response streams) with this
pool in place of httpcore's.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

logger = logging.getLogger(__name__)


class LifoConnectionPool:
    """Idle HTTP/1.1 connections per origin, most recently used first; the httpcore pool interface httpx calls."""

    def __init__(self, keepalive_expiry: float | None, max_keepalive: int) -> None:
        self.keepalive_expiry = keepalive_expiry
        self.max_keepalive = max_keepalive
        self._idle: dict[tuple[bytes, bytes, int], deque[httpcore.AsyncHTTPConnection]] = {}  # by origin
        self._idle_count = 0
        self._open: set[httpcore.AsyncHTTPConnection] = set()  # every connection not closed yet

    @property
    def connections(self) -> int:
        """Connections open now, idle or serving a request."""
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        return self._idle_count

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        connection = await self._take(request.url.origin)
        try:
            response = await connection.handle_async_request(request)
        except BaseException:
            await self._close(connection)
            raise
        return httpcore.Response(status=response.status, headers=response.headers,
                                 content=_ReturningStream(self, request.url.origin, connection, response.stream),
                                 extensions=response.extensions)

    async def _take(self, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        idle = self._idle.get(_key(origin))
        while idle:
            await self._drop_expired(idle)
            if not idle:
                break
            connection = idle.pop()
            self._idle_count -= 1
            # has_expired also sees a connection the engine closed (its socket turned readable at EOF).
            if connection.is_available() and not connection.has_expired():
                return connection
            await self._close(connection)
        connection = httpcore.AsyncHTTPConnection(origin, keepalive_expiry=self.keepalive_expiry)
        self._open.add(connection)
        return connection

    async def _drop_expired(self, idle: deque[httpcore.AsyncHTTPConnection]) -> None:
        """Closes the oldest idle connections while they are past their expiry (or closed by the engine)."""
        while idle and idle[0].has_expired():
            connection = idle.popleft()
            self._idle_count -= 1
            await self._close(connection)

    async def give_back(self, origin: httpcore.Origin, connection: httpcore.AsyncHTTPConnection) -> None:
        """A response is closed: its connection goes back to its origin's stack if it can take another request."""
        if connection.is_idle() and connection.is_available() and self._idle_count < self.max_keepalive:
            idle = self._idle.setdefault(_key(origin), deque())
            idle.append(connection)
            self._idle_count += 1
            await self._drop_expired(idle)
        else:
            await self._close(connection)

    async def _close(self, connection: httpcore.AsyncHTTPConnection) -> None:
        self._open.discard(connection)
        await connection.aclose()

    async def aclose(self) -> None:
        connections, self._open = list(self._open), set()
        self._idle.clear()
        self._idle_count = 0
        for connection in connections:
            await connection.aclose()

    async def __aenter__(self) -> LifoConnectionPool:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


def _key(origin: httpcore.Origin) -> tuple[bytes, bytes, int]:
    return origin.scheme, origin.host, origin.port  # (an Origin compares by value but does not hash)


class _ReturningStream:
    """A response body that hands its connection back to the pool once it is closed."""

    def __init__(self, pool: LifoConnectionPool, origin: httpcore.Origin, connection: httpcore.AsyncHTTPConnection,
                 stream: Any) -> None:
        self.pool, self.origin, self.connection, self.stream = pool, origin, connection, stream
        self.closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.stream.__aiter__()  # the body's own iterator: no extra step per chunk

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self.stream, "aclose"):
                await self.stream.aclose()
        finally:
            await self.pool.give_back(self.origin, self.connection)


class PooledTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a LifoConnectionPool (HTTP/1.1, no proxy: the router talks to its engines)."""

    def __init__(self, keepalive_expiry: float | None, max_keepalive: int) -> None:
        super().__init__()
        # httpx's transport keeps its httpcore pool in `_pool` and calls only its handle_async_request, aclose
        # and context methods: the same surface as LifoConnectionPool's.
        self._pool = LifoConnectionPool(keepalive_expiry, max_keepalive)  # type: ignore[assignment]

    @property
    def pool(self) -> LifoConnectionPool:
        return self._pool  # type: ignore[return-value]
