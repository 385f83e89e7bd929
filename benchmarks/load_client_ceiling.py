"""How many SSE events per second the benches' load generator can take, against a trivial source.

  python -P benchmarks/load_client_ceiling.py [--streams 256] [--events 128] [--ticks-ms 20 5 2 1]
      [--processes 1 2] [--json OUT]

The source (its own process) holds `--streams` streamed completions open and, every tick, writes one
SSE event of the server's shape to each of them, as an engine step does, so that every socket read
carries about one event. The client (bench/load_client.py, with each `--processes`) takes them;
httpx's `aiter_lines` + `json.loads` on one event loop, the load generator before, is the peer on
the same source. Printed per tick: events/s offered and taken, the busiest client process's CPU
busy fraction, client CPU per event, ITL p50 (the tick, when the client keeps up) and the source's
own CPU busy fraction (a source above ~0.9 is the limit, not the client). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx

from splitserve.bench.api_split import cpu_seconds
from splitserve.bench.load_client import StreamRequest, client_summary, run_requests
from splitserve.bench.stats import percentiles

logger = logging.getLogger("load_client_ceiling")

EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1796145750,'
         b'"model":"/tmp/splitserve-tiny","choices":[{"index":0,"logprobs":null,"finish_reason":null,"text":"V",'
         b'"token_ids":[86]}]}\n\n')
DONE = b"data: [DONE]\n\n"
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"connection: close\r\n\r\n")


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class SourceStream(asyncio.Protocol):
    """One request to the source: read its head and body, then take one event per tick."""

    def __init__(self, active: set[SourceStream]) -> None:
        self.active = active
        self.received = b""
        self.left = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += data
        head, sep, body = self.received.partition(b"\r\n\r\n")
        if not sep:
            return
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        if len(body) < length:
            return
        self.left = json.loads(body[:length])["max_tokens"]
        self.transport.write(HEAD)
        self.active.add(self)

    def send_one(self) -> None:
        self.left -= 1
        if self.left > 0:
            self.transport.write(http_chunk(EVENT))
            return
        self.transport.write(http_chunk(EVENT) + http_chunk(DONE) + b"0\r\n\r\n")
        self.transport.close()
        self.active.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.active.discard(self)


async def serve_source(conn: Connection, tick_s: float) -> None:
    active: set[SourceStream] = set()
    server = await asyncio.get_running_loop().create_server(lambda: SourceStream(active), "127.0.0.1", 0,
                                                            backlog=4096)
    conn.send(server.sockets[0].getsockname()[1])
    next_tick = time.perf_counter()
    while not conn.poll():
        next_tick += tick_s
        await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
        for stream in list(active):
            stream.send_one()
    server.close()


def source_main(conn: Connection, tick_s: float) -> None:
    asyncio.run(serve_source(conn, tick_s))


async def httpx_reader(url: str, streams: int, events: int) -> tuple[float, list[float], int]:
    """The load generator before: one httpx.AsyncClient, aiter_lines and json.loads per event."""
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": events, "stream": True}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    itls: list[float] = []
    taken = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal taken
        last = None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                n = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                now = time.perf_counter()
                if last is not None:
                    itls.append((now - last) / n)
                last = now
                taken += 1

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(streams)))
    return time.perf_counter() - start, itls, taken


def measure(tick_s: float, streams: int, events: int, processes: int | None) -> dict:
    """One source at `tick_s`, read by the client with `processes` workers (None: the httpx peer)."""
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    source = ctx.Process(target=source_main, args=(child_end, tick_s), daemon=True)
    source.start()
    try:
        url = f"http://127.0.0.1:{parent_end.recv()}"
        source_cpu = cpu_seconds(source.pid)
        if processes is None:
            cpu = time.process_time()
            wall, itls, taken = asyncio.run(httpx_reader(url, streams, events))
            client = {"busy_max": (time.process_time() - cpu) / wall, "events_per_read": float("nan"),
                      "cpu_us_per_event": (time.process_time() - cpu) / max(1, taken) * 1e6}
            ok = taken == streams * events
        else:
            run = run_requests(url, "m", [StreamRequest([1, 2, 3], events)] * streams, processes, timeout_s=600)
            wall, itls = run.wall_s, [x for t in run.timings for x in t.itls]
            taken = sum(t.events for t in run.timings)
            client = client_summary(run)
            ok = all(t.ok for t in run.timings)
        source_busy = (cpu_seconds(source.pid) - source_cpu) / wall
    finally:
        parent_end.send("stop")
        source.join(timeout=10)
        if source.is_alive():
            source.kill()
            source.join()
    return {"tick_ms": tick_s * 1e3, "reader": "httpx (one process)" if processes is None else f"{processes} processes",
            "ok": ok, "offered_events_per_s": streams / tick_s, "events_per_s": taken / wall, "wall_s": wall,
            "itl_p50_ms": percentiles(itls)["p50"] * 1e3, "client_busy_max": client["busy_max"],
            "client_cpu_us_per_event": client["cpu_us_per_event"], "events_per_read": client["events_per_read"],
            "source_busy": source_busy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--events", type=int, default=128, help="events per stream")
    parser.add_argument("--ticks-ms", type=float, nargs="+", default=[20.0, 5.0, 2.0, 1.0])
    parser.add_argument("--processes", type=int, nargs="+", default=sorted({1, min(8, os.cpu_count() or 1)}))
    parser.add_argument("--httpx-peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    rows = []
    for tick_ms in args.ticks_ms:
        for processes in ([None] if args.httpx_peer else []) + args.processes:
            rows.append(measure(tick_ms / 1e3, args.streams, args.events, processes))
            logger.info("%s", rows[-1])
    print(f"{args.streams} streams x {args.events} events; client figures per process (the busiest)")
    print("tick ms | reader              | offered ev/s | taken ev/s | busy max | us/event | ev/read | ITL p50 ms | "
          "source busy")
    for r in rows:
        print(f"{r['tick_ms']:7.1f} | {r['reader']:<19} | {r['offered_events_per_s']:12.0f} | "
              f"{r['events_per_s']:10.0f} | {r['client_busy_max']:8.0%} | {r['client_cpu_us_per_event']:8.1f} | "
              f"{r['events_per_read']:7.1f} |"
              f" {r['itl_p50_ms']:10.2f} | {r['source_busy']:6.0%}{'' if r['ok'] else '  (requests failed)'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
