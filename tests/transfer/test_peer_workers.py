"""PeerWorkers' merged writes: jobs queued for one peer while its worker is busy share one write, each
learns the result in queue order, a failure fails them all, and jobs that cannot merge run alone.

The write here is a plain function recording its calls: the merged write's real user is the CUDA IPC
backend (tests/transfer/test_cuda_ipc_transfer.py runs it on a GPU)."""

from __future__ import annotations

import threading

import numpy as np

from splitserve.transfer.peer_workers import MergeableWrite, PeerWorkers, TransferJob

from .conftest import wait_until


def _segments(room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([room * 100]), np.array([room * 1000]), np.array([room])


def test_queued_jobs_share_one_write_and_finish_in_order():
    calls: list[tuple[str, list[int], list[int], list[int]]] = []
    gate = threading.Event()
    results: list[tuple[int, int | None]] = []
    failures: list[tuple[int, Exception]] = []

    def write(session, srcs, dsts, lens) -> int:
        calls.append((session, srcs.tolist(), dsts.tolist(), lens.tolist()))
        return 0

    def job(room: int, mergeable: bool = True) -> TransferJob:
        def merge() -> MergeableWrite:
            return MergeableWrite("peer-session", *_segments(room), lambda code: results.append((room, code)))

        return TransferJob("tcp://decode:1", room, lambda: results.append((room, "ran")),  # type: ignore[arg-type]
                           lambda exc: failures.append((room, exc)), merge if mergeable else None)

    workers = PeerWorkers(1, idle_s=5.0, write=write)
    try:
        workers.submit(TransferJob("tcp://decode:1", 0, gate.wait, lambda exc: None))  # keeps the worker busy
        for room in (1, 2, 3):
            workers.submit(job(room))
        workers.submit(job(4, mergeable=False))
        workers.submit(job(5))
        gate.set()
        assert wait_until(lambda: len(results) == 5, 10), results
    finally:
        workers.close()
    # 4 cannot merge: it runs on its own and ends the batch; 5, alone after it, simply runs too.
    assert results == [(1, 0), (2, 0), (3, 0), (4, "ran"), (5, "ran")]
    assert calls == [("peer-session", [100, 200, 300], [1000, 2000, 3000], [1, 2, 3])]
    assert workers.merged_writes == 1 and not failures
    assert workers.threads == 0


def test_a_merged_write_that_raises_fails_every_room_in_it():
    gate = threading.Event()
    done: list[tuple[int, int | None]] = []
    failures: list[int] = []

    def write(session, srcs, dsts, lens) -> int:
        raise RuntimeError("peer unmapped")

    workers = PeerWorkers(1, idle_s=5.0, write=write)
    try:
        workers.submit(TransferJob("p", 0, gate.wait, lambda exc: None))
        for room in (1, 2):
            workers.submit(TransferJob(
                "p", room, lambda: None, lambda exc, r=room: failures.append(r),
                lambda r=room: MergeableWrite("s", *_segments(r), lambda code, r=r: done.append((r, code)))))
        gate.set()
        assert wait_until(lambda: len(failures) == 2, 10)
    finally:
        workers.close()
    assert done == [(1, None), (2, None)]  # each learns the write did not return (its write count ends)
    assert failures == [1, 2]
