"""The benches' load generator (bench/load_client.py) against a real tiny server: several client
processes return what one does, failures are reported per request, arrivals hold across workers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from servers import free_port, served

from splitserve.bench.load_client import (
    ClientRun,
    StreamRequest,
    WorkerStats,
    client_line,
    client_summary,
    run_requests,
    worker_count,
)

CONTEXT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    log = tmp_path_factory.mktemp("bench-client") / "server.log"
    with served(["--model", "tiny", "--device", "cpu", "--context-length", str(CONTEXT), "--max-running-requests",
                 "8", "--disable-prefix-cache"], log) as url:
        yield url, httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def requests_of(output_lens: list[int], arrivals: list[float] | None = None) -> list[StreamRequest]:
    arrivals = arrivals or [0.0] * len(output_lens)
    return [StreamRequest([(7 * i + j) % 200 + 1 for j in range(8 + i)], n, a)
            for i, (n, a) in enumerate(zip(output_lens, arrivals, strict=True))]


def test_three_processes_return_what_one_does_in_request_order(server: tuple[str, str]) -> None:
    url, model = server
    output_lens = [2, 3, 4, 5, 6, 7, 8]
    one = run_requests(url, model, requests_of(output_lens), processes=1)
    three = run_requests(url, model, requests_of(output_lens), processes=3)
    assert len(one.workers) == 1 and len(three.workers) == 3
    assert [w.requests for w in three.workers] == [3, 2, 2]  # round-robin
    for run in (one, three):
        assert [t.ok for t in run.timings] == [True] * len(output_lens), [t.error for t in run.timings]
        assert [t.output_tokens for t in run.timings] == output_lens  # merged back in request order
        assert all(0 < t.ttft <= t.latency for t in run.timings)
        assert all(len(t.itls) == n - 1 for t, n in zip(run.timings, output_lens, strict=True))
        assert sum(w.events for w in run.workers) >= sum(output_lens)
        assert all(w.cpu_s > 0 and w.wall_s > 0 for w in run.workers)
        summary = client_summary(run)
        assert summary["processes"] == len(run.workers) and summary["busy_max"] == max(summary["busy"])
        assert summary["cpu_us_per_event"] > 0


def test_a_failing_request_is_reported_and_the_others_complete(server: tuple[str, str]) -> None:
    url, model = server
    requests = requests_of([3, 3, 3, 3])
    too_long = StreamRequest(list(range(1, CONTEXT + 20)), 3)  # longer than the server's context
    run = run_requests(url, model, [*requests[:2], too_long, *requests[2:]], processes=2)
    assert [t.ok for t in run.timings] == [True, True, False, True, True]
    bad = run.timings[2]
    assert bad.error.startswith("HTTP 400") and bad.output_tokens == 0
    assert [t.output_tokens for t in run.timings] == [3, 3, 0, 3, 3]


def test_a_refused_connection_is_an_error_not_a_hang() -> None:
    run = run_requests(f"http://127.0.0.1:{free_port()}", "m", requests_of([3, 3]), processes=2, timeout_s=30)
    assert [t.ok for t in run.timings] == [False, False]
    assert all("ConnectionRefusedError" in t.error for t in run.timings)


def test_a_worker_that_fails_stops_the_run_with_its_error() -> None:
    with pytest.raises(RuntimeError, match=r"client worker bench-client-0 failed: .*Port could not be cast"):
        run_requests("http://127.0.0.1:notaport", "m", requests_of([3, 3, 3]), processes=3)


def test_open_loop_arrivals_hold_across_workers(server: tuple[str, str]) -> None:
    url, model = server
    arrivals = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    run = run_requests(url, model, requests_of([2] * 6, arrivals), processes=3)
    assert all(t.ok for t in run.timings)
    sent = [t.sent_at - run.start for t in run.timings]
    assert all(s >= a for s, a in zip(sent, arrivals, strict=True)), sent  # never early
    assert sent == sorted(sent), sent  # interleaved over three workers, still in arrival order
    assert run.wall_s >= arrivals[-1]


def test_closed_loop_concurrency_is_split_over_the_workers(server: tuple[str, str]) -> None:
    url, model = server
    run = run_requests(url, model, requests_of([2] * 5), processes=4, concurrency=2)
    assert len(run.workers) == 2 and all(t.ok for t in run.timings)
    assert worker_count(8, requests=3, concurrency=None) == 3
    assert worker_count(8, requests=300, concurrency=16) == 8
    with pytest.raises(ValueError, match="client processes must be >= 1"):
        worker_count(0, requests=3, concurrency=None)


def test_a_busy_worker_marks_the_figures_client_bound() -> None:
    def run_of(*busy: float) -> ClientRun:
        return ClientRun([], 0.0, 1.0, [WorkerStats(1, 100, 100, b, 1.0, 0.001) for b in busy])

    calm, busy = client_summary(run_of(0.3, 0.5)), client_summary(run_of(0.3, 0.9))
    assert not calm["client_bound"] and "WARNING" not in client_line(calm)
    assert busy["client_bound"] and busy["busy_max"] == 0.9
    assert "WARNING" in client_line(busy) and "90%" in client_line(busy)

