"""The HTTP benches' load generator: streamed requests spread over client worker processes.

One Python process reading every SSE event of 256 streams can saturate its own core, and then the
client, not the server, sets the measured tok/s, TTFT and ITL (an event is timed when the client
gets round to it). So the requests go round-robin to `processes` workers (spawned, each its own
event loop); all of them wait for one start time on the system-wide monotonic clock
(`time.perf_counter` is CLOCK_MONOTONIC on Linux), so open-loop arrival times stay exact across
workers, and their timings are merged in request order. Each worker reports its CPU time over its
wall time: a worker above `CLIENT_BUSY_LIMIT` means the figures are client-bound.

Spawned workers import the caller's main module again, as multiprocessing's spawn does: a script
that uses this must keep its work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from splitserve.bench.stream import RequestTiming, completion_body, http_post, stream_completion

logger = logging.getLogger(__name__)

CLIENT_BUSY_LIMIT = 0.8  # a worker busier than this may have timed events late
START_MARGIN_S = 0.05  # from sending the start time to the start, so that every worker sees it first
READY_TIMEOUT_S = 120.0
LAG_PROBE_S = 0.005


def default_client_processes() -> int:
    """--client-processes' default: one worker per CPU, up to 8."""
    return min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class StreamRequest:
    """One request of a load: its prompt, output tokens, and arrival (s after the load's start)."""

    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class WorkerStats:
    """One client worker over its own run (the start to its last request's end)."""

    requests: int
    events: int
    reads: int
    cpu_s: float
    wall_s: float
    loop_lag_p99_s: float  # how late a 5 ms sleep of its event loop woke up

    @property
    def busy(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class ClientRun:
    """Every request's timing (in request order), the load's shared start (time.perf_counter) and
    wall time, and each worker's stats."""

    timings: list[RequestTiming]
    start: float
    wall_s: float
    workers: list[WorkerStats]


def worker_count(processes: int, requests: int, concurrency: int | None) -> int:
    """Workers actually used: no more than there are requests, or slots of a closed loop."""
    if processes < 1:
        raise ValueError(f"client processes must be >= 1, got {processes}")
    return max(1, min(processes, requests, concurrency or requests))


def run_requests(url: str, model: str, requests: list[StreamRequest], processes: int,
                 concurrency: int | None = None, timeout_s: float = 3600,
                 headers: dict[str, str] | None = None) -> ClientRun:
    """Sends `requests` to `url` from `processes` workers: each at its arrival time (open loop), or,
    with `concurrency`, at most that many in flight in all (closed loop, split over the workers); `headers` go
    with every request."""
    n = worker_count(processes, len(requests), concurrency)
    shares = [list(range(w, len(requests), n)) for w in range(n)]
    ctx = multiprocessing.get_context("spawn")  # the parent may hold CUDA or engine threads: no fork
    conns: list[Connection] = []
    procs = []
    results = None
    try:
        for w, share in enumerate(shares):
            gate = None if concurrency is None else concurrency // n + (w < concurrency % n)
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"bench-client-{w}", daemon=True,
                               args=(child_end, url, model, [requests[i] for i in share], gate, timeout_s, headers))
            proc.start()
            child_end.close()
            conns.append(parent_end)
            procs.append(proc)
        for proc, conn in zip(procs, conns, strict=True):
            _receive(conn, proc, READY_TIMEOUT_S)
        start = time.perf_counter() + START_MARGIN_S
        for conn in conns:
            conn.send(start)
        # no deadline here: each request has its own (timeout_s), so a live worker reports in the end
        results = [_receive(conn, proc, None) for proc, conn in zip(procs, conns, strict=True)]
    finally:
        for proc in procs:
            if results is None:  # failed or interrupted: the others may wait for a start that never comes
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()
    timings: list[RequestTiming | None] = [None] * len(requests)
    for share, (worker_timings, _, _) in zip(shares, results, strict=True):
        for i, timing in zip(share, worker_timings, strict=True):
            timings[i] = timing
    wall = max(end for _, end, _ in results) - start
    return ClientRun(timings, start, wall, [stats for _, _, stats in results])  # type: ignore[arg-type]


def _receive(conn: Connection, proc: BaseProcess, timeout_s: float | None) -> Any:
    """The worker's next message; a clear error if it died or went silent for `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"client worker {proc.name} exited with code {proc.exitcode} before reporting")
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"client worker {proc.name} sent nothing for {timeout_s:.0f} s")
    try:
        message = conn.recv()
    except EOFError:  # it closed its end: it died
        proc.join(timeout=5)
        raise RuntimeError(f"client worker {proc.name} exited with code {proc.exitcode} before reporting") from None
    if isinstance(message, BaseException):
        raise RuntimeError(f"client worker {proc.name} failed: {message!r}") from message
    return message


def _worker_main(conn: Connection, url: str, model: str, requests: list[StreamRequest], concurrency: int | None,
                 timeout_s: float, headers: dict[str, str] | None) -> None:
    try:
        posts = [http_post(url, "/v1/completions", completion_body(model, r.prompt, r.output_len), headers)
                 for r in requests]
        conn.send("ready")
        start = conn.recv()
        conn.send(asyncio.run(_drive(url, posts, requests, start, concurrency, timeout_s)))
    except Exception as exc:  # reported to the parent, which raises it
        conn.send(exc)
    finally:
        conn.close()


async def _drive(url: str, posts: list[bytes], requests: list[StreamRequest], start: float,
                 concurrency: int | None, timeout_s: float) -> tuple[list[RequestTiming], float, WorkerStats]:
    """This worker's requests from `start` on; its timings, its end time and its stats."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    cpu_start = time.process_time()
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    lags: list[float] = []
    probe = asyncio.create_task(_probe_loop_lag(lags))

    async def one(i: int) -> RequestTiming:
        delay = start + requests[i].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            return await stream_completion(url, posts[i], requests[i].output_len, timeout_s)
        async with gate:
            return await stream_completion(url, posts[i], requests[i].output_len, timeout_s)

    try:
        timings = await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        probe.cancel()
    end = time.perf_counter()
    lag_p99 = sorted(lags)[int(0.99 * len(lags))] if lags else 0.0
    stats = WorkerStats(len(requests), sum(t.events for t in timings), sum(t.reads for t in timings),
                        time.process_time() - cpu_start, end - start, lag_p99)
    return timings, end, stats


async def _probe_loop_lag(lags: list[float]) -> None:
    while True:
        before = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(time.perf_counter() - before - LAG_PROBE_S)


def client_summary(run: ClientRun) -> dict:
    """The client's own figures for a report: processes, busy fraction per worker (the max is the
    one that matters), CPU per SSE event, and whether the figures are client-bound."""
    events = sum(w.events for w in run.workers)
    busy = [w.busy for w in run.workers]
    return {"processes": len(run.workers), "busy": busy, "busy_max": max(busy), "events": events,
            "events_per_s": events / run.wall_s if run.wall_s > 0 else 0.0,
            "cpu_us_per_event": sum(w.cpu_s for w in run.workers) / max(1, events) * 1e6,
            "events_per_read": events / max(1, sum(w.reads for w in run.workers)),
            "loop_lag_p99_ms": max(w.loop_lag_p99_s for w in run.workers) * 1e3,
            "client_bound": max(busy) > CLIENT_BUSY_LIMIT}


def client_line(client: dict) -> str:
    """One report line on the client; a warning in it when a worker was too busy to be trusted."""
    line = (f"client: {client['processes']} processes, busy max {client['busy_max']:.0%} "
            f"(each {' '.join(f'{b:.0%}' for b in client['busy'])}), {client['cpu_us_per_event']:.0f} us CPU "
            f"per SSE event, {client['events_per_s']:.0f} events/s ({client['events_per_read']:.1f} per socket read), "
            f"loop lag p99 {client['loop_lag_p99_ms']:.1f} ms")
    if client["client_bound"]:
        line += (f"\nWARNING: a client worker was over {CLIENT_BUSY_LIMIT:.0%} busy: these figures are set by the "
                 "load generator, not the server (raise --client-processes)")
    return line
