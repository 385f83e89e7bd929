"""PeerWorkers' merged writes: jobs queued for one peer while its worker is busy share one write, each
learns the result in queue order, a failure fails them all, and jobs that cannot merge run alone.

The write here is a plain function recording its calls: the merged write's real user is the CUDA IPC
backend (tests/transfer/test_cuda_ipc_transfer.py runs it on a GPU)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from splitserve.transfer import layout_for_pool, make_aux_tensor
from splitserve.transfer.kv.plan import EMPTY, PageCopy, aux_segment
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


def test_whole_pages_go_as_one_page_runs_write_where_the_transport_takes_them():
    """With ``launch_pages`` (CUDA IPC), queued jobs of whole pages reach it as one ``PageRuns`` (runs once,
    not per buffer), a job alone takes it too, and a job of general segments (a decode prefix) goes to
    ``write`` after the copies launched before it landed."""
    src, dst = torch.zeros((2, 2, 16, 4, 2, 3)), torch.zeros((2, 2, 16, 4, 2, 3))
    sl, dl = layout_for_pool(src, make_aux_tensor(4)), layout_for_pool(dst, make_aux_tensor(4))
    gate = threading.Event()
    page_calls, calls, results = [], [], []

    def write(session, srcs, dsts, lens) -> int:
        calls.append(len(lens))
        return 0

    def launch_pages(session, runs):
        page_calls.append((runs.src_offs.tolist(), runs.dst_offs.tolist(), runs.lens.tolist(), len(runs.aux)))
        return lambda: 0

    def job(room: int, pages: tuple[list[int], list[int]] | None) -> TransferJob:
        def merge() -> MergeableWrite:
            copy = None if pages is None else PageCopy(sl, dl, np.array(pages[0]), np.array(pages[1]),
                                                       aux_segment(sl, room % 4, dl, room % 4))
            segs = _segments(room) if pages is None else (EMPTY.srcs, EMPTY.dsts, EMPTY.lens)
            return MergeableWrite("s", *segs, lambda code: results.append((room, code)), copy)

        return TransferJob("p", room, lambda: results.append((room, "ran")), lambda exc: None, merge)

    workers = PeerWorkers(1, idle_s=5.0, write=write, launch_pages=launch_pages)
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


def test_a_long_batch_is_pipelined_each_part_launched_before_the_last_is_waited_for():
    """``PIPELINE_JOBS`` jobs per launched copy: part k+1 is prepared and launched before part k is waited for
    and its jobs finished, every job finishes in queue order, and a copy that fails to land fails its part's
    jobs only."""
    from splitserve.transfer.peer_workers import PIPELINE_JOBS

    src, dst = torch.zeros((1, 2, 200, 4, 2, 3)), torch.zeros((1, 2, 200, 4, 2, 3))
    sl, dl = layout_for_pool(src, make_aux_tensor(4)), layout_for_pool(dst, make_aux_tensor(4))
    gate = threading.Event()
    events: list[str] = []
    done: list[tuple[int, int | None]] = []
    failed: list[int] = []
    rooms = 2 * PIPELINE_JOBS + 5

    def launch_pages(session, runs):
        part = len([e for e in events if e.startswith("launch")])
        events.append(f"launch {part} ({len(runs.lens)} rooms)")

        def landed() -> int:
            events.append(f"landed {part}")
            if part == 1:
                raise RuntimeError("peer unmapped")
            return 0

        return landed

    def job(room: int) -> TransferJob:
        def merge() -> MergeableWrite:
            events.append(f"prepare {room}") if room % PIPELINE_JOBS == 0 else None
            return MergeableWrite("s", EMPTY.srcs, EMPTY.dsts, EMPTY.lens, lambda code: done.append((room, code)),
                                  PageCopy(sl, dl, np.array([room]), np.array([room]), EMPTY))

        return TransferJob("p", room, lambda: None, lambda exc: failed.append(room), merge)

    workers = PeerWorkers(1, idle_s=5.0, write=lambda *a: 0, launch_pages=launch_pages)
    try:
        workers.submit(TransferJob("p", -1, gate.wait, lambda exc: None))
        for room in range(rooms):
            workers.submit(job(room))
        gate.set()
        assert wait_until(lambda: len(done) == rooms, 10)
    finally:
        workers.close()
    p = PIPELINE_JOBS
    assert events == ["prepare 0", f"launch 0 ({p} rooms)", f"prepare {p}", f"launch 1 ({p} rooms)", "landed 0",
                      f"prepare {2 * p}", "launch 2 (5 rooms)", "landed 1", "landed 2"]
    assert [r for r, _ in done] == list(range(rooms))  # queue order
    assert failed == list(range(p, 2 * p))  # the part whose copy failed, only
    assert {code for r, code in done if p <= r < 2 * p} == {None}
    assert {code for r, code in done if not p <= r < 2 * p} == {0}


def test_writes_sharing_a_finish_are_finished_together_per_part_and_fail_one_by_one():
    """Writes that name one ``finish`` get it once per part with the code, in queue order; an exception it
    returns for one write fails that job only, a finish that raises fails the part's jobs; the part's
    ``finish_together`` hears whether nothing was queued or in flight behind it."""
    from splitserve.transfer.peer_workers import PIPELINE_JOBS

    pool = torch.zeros((2, 2, 64, 1, 1, 8), dtype=torch.bfloat16)
    layout = layout_for_pool(pool, make_aux_tensor(4))
    gate = threading.Event()
    calls: list[tuple[list[int], int | None]] = []
    failed: list[int] = []
    lasts: list[bool] = []
    rooms = PIPELINE_JOBS + 3

    def finish(writes, code):
        rooms_here = [w.owner for w in writes]
        calls.append((rooms_here, code))
        if PIPELINE_JOBS in rooms_here:  # the second part's finish itself breaks
            raise RuntimeError("bookkeeping broke")
        return [ValueError("room 5's pages") if r == 5 else None for r in rooms_here]

    class Together:
        def __init__(self, last: bool) -> None:
            lasts.append(last)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    def job(room: int) -> TransferJob:
        def merge() -> MergeableWrite:
            return MergeableWrite("s", EMPTY.srcs, EMPTY.dsts, EMPTY.lens, None,
                                  PageCopy(layout, layout, np.array([room]), np.array([room])), finish, room)

        return TransferJob("p", room, lambda: None, lambda exc: failed.append(room), merge)

    workers = PeerWorkers(1, idle_s=5.0, write=lambda *a: 0, launch_pages=lambda session, runs: lambda: 0,
                          finish_together=Together)
    try:
        workers.submit(TransferJob("p", -1, gate.wait, lambda exc: None))
        for room in range(rooms):
            workers.submit(job(room))
        gate.set()
        assert wait_until(lambda: len(calls) == 2, 10), calls
    finally:
        workers.close()
    assert calls == [(list(range(PIPELINE_JOBS)), 0), (list(range(PIPELINE_JOBS, rooms)), 0)]
    assert failed == [5, *range(PIPELINE_JOBS, rooms)]
    assert lasts == [False, True]  # the first part had the second in flight behind it


def test_wait_issued_returns_once_the_copies_are_queued_not_once_they_land():
    """A prefill whose steps share the device's stream with the copies waits until the shipped rooms' copies are
    queued (``wait_issued``), not until they landed; a job that raises counts as issued; a worker held up past
    the timeout makes the wait say so."""
    src, dst = torch.zeros((1, 2, 8, 4, 2, 3)), torch.zeros((1, 2, 8, 4, 2, 3))
    sl, dl = layout_for_pool(src, make_aux_tensor(4)), layout_for_pool(dst, make_aux_tensor(4))
    hold_launch, hold_landing = threading.Event(), threading.Event()
    launched, landed = [], []

    def launch_pages(session, runs):
        hold_launch.wait(10)
        launched.append(len(runs.lens))

        def land() -> int:
            hold_landing.wait(10)
            landed.append(len(runs.lens))
            return 0

        return land

    def job(room: int) -> TransferJob:
        def merge() -> MergeableWrite:
            return MergeableWrite("s", EMPTY.srcs, EMPTY.dsts, EMPTY.lens, lambda code: None,
                                  PageCopy(sl, dl, np.array([room]), np.array([room]), EMPTY))

        return TransferJob("p", room, lambda: None, lambda exc: None, merge)

    def broken() -> None:
        raise RuntimeError("peer gone")

    workers = PeerWorkers(1, idle_s=5.0, write=lambda *a: 0, launch_pages=launch_pages)
    try:
        assert workers.wait_issued(0.0)  # nothing submitted: nothing to wait for
        workers.submit(job(1))
        assert not workers.wait_issued(0.2) and not launched  # its launch is held: not queued yet
        hold_launch.set()
        assert workers.wait_issued(10) and launched == [1] and not landed  # queued, still landing
        hold_landing.set()
        assert wait_until(lambda: landed == [1], 10)
        workers.submit(TransferJob("p", 2, broken, lambda exc: None))
        assert workers.wait_issued(10)
    finally:
        workers.close()
    assert workers.threads == 0
