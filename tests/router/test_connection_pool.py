"""The router's connection pool (router/connection_pool.py) against a real HTTP/1.1 server on loopback: idle
connections are reused most-recent first, given back only once their response is closed and whole, let go of
after their keep-alive expiry or once the server closed them, and never pooled past `max_keepalive`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.router.connection_pool import PooledTransport


class Server:
    """HTTP/1.1 with keep-alive: `/ok` answers 5 bytes, `/big` 1 MiB, `/close` answers and closes the connection,
    `/hold` answers and closes it 0.2 s later (an engine's keep-alive timeout); counts connections accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                body = b"x" * (1 << 20) if path == b"/big" else b"hello"
                close = path == b"/close"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (
                    len(body), b"Connection: close\r\n" if close else b"") + body)
                await writer.drain()
                if close:
                    break
                if path == b"/hold":
                    await asyncio.sleep(0.2)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def run(test):
    async def main() -> None:
        server = Server()
        url = await server.start()
        try:
            await test(server, url)
        finally:
            await server.stop()
    asyncio.run(main())


def test_idle_connections_are_reused_and_concurrent_streams_each_get_one() -> None:
    async def test(server: Server, url: str) -> None:
        transport = PooledTransport(keepalive_expiry=30.0, max_keepalive=8)
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(5):
                assert (await client.get(f"{url}/ok")).content == b"hello"
            assert server.accepted == 1 and transport.pool.connections == 1 == transport.pool.idle_connections
            # Ten at once: ten connections; eight stay pooled (max_keepalive), two are closed.
            answers = await asyncio.gather(*(client.get(f"{url}/ok") for _ in range(10)))
            assert all(a.content == b"hello" for a in answers)
            assert server.accepted == 10 and transport.pool.idle_connections == 8 == transport.pool.connections
            await asyncio.gather(*(client.get(f"{url}/ok") for _ in range(8)))
            assert server.accepted == 10  # the eight pooled ones served them
        assert transport.pool.connections == 0  # the client's close closed the pool
    run(test)


def test_a_response_goes_back_only_once_closed_and_whole() -> None:
    async def test(server: Server, url: str) -> None:
        transport = PooledTransport(keepalive_expiry=30.0, max_keepalive=8)
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", f"{url}/big") as response:
                assert transport.pool.idle_connections == 0  # still streaming: not the pool's
                async for _ in response.aiter_raw():
                    break  # read part of it only
            # Closed mid-body: the connection cannot carry another request and is closed, not pooled.
            assert transport.pool.idle_connections == 0 and transport.pool.connections == 0
            async with client.stream("GET", f"{url}/big") as response:
                assert len(await response.aread()) == 1 << 20
            assert transport.pool.idle_connections == 1 and server.accepted == 2
    run(test)


def test_expired_connections_and_those_the_server_closed_are_let_go_of() -> None:
    async def test(server: Server, url: str) -> None:
        transport = PooledTransport(keepalive_expiry=0.1, max_keepalive=8)
        async with httpx.AsyncClient(transport=transport) as client:
            await client.get(f"{url}/ok")
            await asyncio.sleep(0.15)  # past the pool's expiry: a new connection, the old one closed
            await client.get(f"{url}/ok")
            assert server.accepted == 2 and transport.pool.connections == 1
        transport = PooledTransport(keepalive_expiry=30.0, max_keepalive=8)
        async with httpx.AsyncClient(transport=transport) as client:
            await client.get(f"{url}/close")  # Connection: close: never pooled
            assert transport.pool.connections == 0
            await client.get(f"{url}/hold")  # pooled, then the server closes it while it is idle
            assert transport.pool.idle_connections == 1
            await asyncio.sleep(0.4)
            assert (await client.get(f"{url}/ok")).content == b"hello"  # on a new connection, without an error
            assert server.accepted == 5 and transport.pool.connections == 1
    run(test)


@pytest.mark.parametrize("max_keepalive", [0, 1])
def test_nothing_is_pooled_past_max_keepalive(max_keepalive: int) -> None:
    async def test(server: Server, url: str) -> None:
        transport = PooledTransport(keepalive_expiry=30.0, max_keepalive=max_keepalive)
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(3):
                await client.get(f"{url}/ok")
            assert server.accepted == (3 if max_keepalive == 0 else 1)
            assert transport.pool.idle_connections == max_keepalive
    run(test)


def test_a_refused_connection_is_an_httpx_error_and_leaves_nothing_open() -> None:
    async def test(server: Server, url: str) -> None:
        await server.stop()
        transport = PooledTransport(keepalive_expiry=30.0, max_keepalive=8)
        async with httpx.AsyncClient(transport=transport) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"{url}/ok")
            assert transport.pool.connections == 0

    async def main() -> None:
        server = Server()
        url = await server.start()
        await test(server, url)
    asyncio.run(main())
