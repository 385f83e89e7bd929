"""PeerWorkers' merged writes: jobs queued for one peer while its worker is busy share one write, each
learns the result in queue order, a failure fails them all, and jobs that cannot merge run alone.

The write here is a plain function recording its calls: the merged write's real user is the CUDA IPC
backend (tests/transfer/test_cuda_ipc_transfer.py runs it on a GPU)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from splitserve.transfer import layout_for_pool, make_aux_tensor
from splitserve.transfer.peer_workers import MergeableWrite, PeerWorkers, TransferJob
from splitserve.transfer.transfer_plan import EMPTY, PageCopy, aux_segment

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


def test_whole_pages_go_as_one_page_runs_write_where_the_transport_takes_them():
    """With ``write_pages`` (CUDA IPC), queued jobs of whole pages reach it as one ``PageRuns`` (runs once,
    not per buffer), a job alone takes it too, and a batch with a job of general segments falls back to
    ``write`` with every job's segments."""
    src, dst = torch.zeros((2, 2, 16, 4, 2, 3)), torch.zeros((2, 2, 16, 4, 2, 3))
    sl, dl = layout_for_pool(src, make_aux_tensor(4)), layout_for_pool(dst, make_aux_tensor(4))
    gate = threading.Event()
    page_calls, calls, results = [], [], []

    def write(session, srcs, dsts, lens) -> int:
        calls.append(len(lens))
        return 0

    def write_pages(session, runs) -> int:
        page_calls.append((runs.src_offs.tolist(), runs.dst_offs.tolist(), runs.lens.tolist(), len(runs.aux)))
        return 0

    def job(room: int, pages: tuple[list[int], list[int]] | None) -> TransferJob:
        def merge() -> MergeableWrite:
            copy = None if pages is None else PageCopy(sl, dl, np.array(pages[0]), np.array(pages[1]),
                                                       aux_segment(sl, room % 4, dl, room % 4))
            segs = _segments(room) if pages is None else (EMPTY.srcs, EMPTY.dsts, EMPTY.lens)
            return MergeableWrite("s", *segs, lambda code: results.append((room, code)), copy)

        return TransferJob("p", room, lambda: results.append((room, "ran")), lambda exc: None, merge)

    workers = PeerWorkers(1, idle_s=5.0, write=write, write_pages=write_pages)
    try:
        workers.submit(TransferJob("p", 0, gate.wait, lambda exc: None))
        workers.submit(job(1, ([0, 1, 2], [5, 6, 7])))
        workers.submit(job(2, ([3, 9], [8, 1])))
        gate.set()
        assert wait_until(lambda: len(results) == 2, 10)
        workers.submit(job(3, ([4], [4])))  # alone
        assert wait_until(lambda: len(results) == 3, 10)
        gate.clear()
        workers.submit(TransferJob("p", 0, gate.wait, lambda exc: None))
        workers.submit(job(4, ([10], [11])))
        workers.submit(job(5, None))  # a room with general segments (a decode prefix): no page runs
        gate.set()
        assert wait_until(lambda: len(results) == 5, 10)
    finally:
        workers.close()
    page = sl.buffers[0].page_bytes
    assert page_calls == [([0, 3 * page, 9 * page], [5 * page, 8 * page, page], [3 * page, page, page], 2),
                          ([4 * page], [4 * page], [page], 1)]
    assert calls == [len(sl.buffers) * 1 + 1 + 1]  # room 4's run per buffer and aux, room 5's one segment
    assert results == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
