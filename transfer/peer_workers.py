"""Worker threads per peer: a peer whose Mooncake calls block (30-60 s on a frozen or
blackholing host) holds only its own workers, never another peer's rooms.

Workers start on a peer's first job and end after ``idle_s`` without one, so the thread count
returns to its start once the peers go away (a worker stuck in a call to a dead peer ends when
the call returns). One room's jobs to one peer always go to the same worker, in order. A job
that raises fails its own room (``TransferJob.fail``); the worker carries on.

Merged writes: where one copy of many segments costs about what one of few does (CUDA IPC: one
kernel launch, one wait), a job may offer its write instead of running it (``TransferJob.merge``).
A worker that finds several such jobs queued for the same peer prepares each (``MergeableWrite``:
segments counted as begun by the manager), writes them all with one call and hands each its
result, in queue order, inside ``finish_together`` (the manager sends their Success messages as
one per decode rank then). Where the transport takes whole pages as runs (``launch_pages``: CUDA IPC),
the jobs' pages go as ``PageRuns`` (its kernel expands them per buffer), a job alone in the queue takes
that path too, and a long batch is pipelined: ``PIPELINE_JOBS`` jobs at a time are prepared and their copy
launched, then the previous part's copy is waited for and its jobs finished, so the host's work per room
runs while the device copies. Otherwise a job alone simply runs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.transfer.kv.plan import PageCopy, PageRuns, Segments, concat, plan_page_copies, plan_page_runs

log = logging.getLogger(__name__)


MAX_MERGED_JOBS = 256  # jobs one merged write takes at most
# Jobs per launched copy in a pipelined batch: 64 rooms of 512 tokens are ~4 GiB of Llama-3-8B KV (~2.2 ms of copy),
# about what preparing and finishing 64 rooms costs the host, so each hides the other, and a launch (~0.3-0.5 ms of
# the H200 host's Python: checks, table, Triton's launch) is paid once per 64 rooms. 256 x 512-token rooms on an
# H200: 0.46 / 0.48 of the device copy at 32, 0.63 / 0.56 at 64 (bench --profile transfer --transfer-protocol cuda_ipc).
PIPELINE_JOBS = 64


@dataclass(slots=True)  # not frozen: made once a room on the hot path (a frozen init costs ~3x)
class MergeableWrite:
    """One job's write, begun and ready to share a copy: its segments to ``session`` (or ``pages``, whole
    pages planned with the other jobs' in one pass), and ``done``, called with the merged write's return
    code (``None`` if it raised) once it returned. Or, instead of ``done``, ``finish``: called once with every
    write of a part that shares it (in queue order) and the code, returning each write's exception or ``None``
    (the rooms of a part finish in one pass; ``owner`` is whatever ``finish`` needs of each write)."""

    session: str
    srcs: np.ndarray
    dsts: np.ndarray
    lens: np.ndarray
    done: Callable[[int | None], None] | None
    pages: PageCopy | None = None
    finish: Callable[[Sequence[MergeableWrite], int | None], list[Exception | None]] | None = None
    owner: Any = None


WriteFn = Callable[[str, np.ndarray, np.ndarray, np.ndarray], int]
LaunchPagesFn = Callable[[str, PageRuns], Callable[[], int]]


@dataclass(slots=True)  # not frozen: made once a room on the hot path (a frozen init costs ~3x)
class TransferJob:
    """Writes of one chunk of one room to one peer; ``run`` does the I/O, off the manager's lock;
    ``fail`` is called with the exception if ``run`` raises. ``merge``, where set, prepares the job's
    write for a merged one instead (``None``: nothing to write, the job is done)."""

    peer: str
    room: int
    run: Callable[[], None]
    fail: Callable[[Exception], None]
    merge: Callable[[], MergeableWrite | None] | None = None


Prepared = list[tuple[TransferJob, MergeableWrite]]


def _page_runs_of(writes: list[MergeableWrite]) -> PageRuns | None:
    """The writes as one ``PageRuns`` where every one is whole pages between one pair of layouts (a peer
    session is one decode rank: always, but for a room with a decode prefix or another TP size), else None."""
    pages = [w.pages for w in writes]
    first = pages[0]
    if first is None or any(p is None or p.src is not first.src or p.dst is not first.dst for p in pages):
        return None
    return plan_page_runs(pages)  # type: ignore[arg-type]


def _segments_of(writes: list[MergeableWrite]) -> Segments:
    """Every write's segments, the whole-page ones planned together (one pass per pair of layouts)."""
    paged: dict[tuple[int, int], list[PageCopy]] = {}
    parts = []
    for w in writes:
        if w.pages is None:
            parts.append(Segments(w.srcs, w.dsts, w.lens))
        else:
            paged.setdefault((id(w.pages.src), id(w.pages.dst)), []).append(w.pages)
    parts.extend(plan_page_copies(copies) for copies in paged.values())
    return parts[0] if len(parts) == 1 else concat(parts)


class _Worker:
    def __init__(self) -> None:
        self.jobs: collections.deque[TransferJob] = collections.deque()
        self.thread: threading.Thread | None = None


class PeerWorkers:
    """``per_peer`` worker threads for each peer, started on demand, gone after ``idle_s`` idle."""

    def __init__(self, per_peer: int, idle_s: float, name: str = "transfer-worker",
                 write: WriteFn | None = None, launch_pages: LaunchPagesFn | None = None,
                 finish_together: Callable[[bool], contextlib.AbstractContextManager] | None = None) -> None:
        self.per_peer = per_peer
        self.write = write  # how merged writes go out (None: jobs always run one by one)
        # How whole pages go out as runs, where the transport takes them: returns once the copy is queued, with
        # the call that waits for it.
        self.launch_pages = launch_pages
        # Held while a merged write's jobs finish (the manager: their Success messages go out as one); its
        # argument says whether nothing is queued or in flight behind them.
        self.finish_together = finish_together or contextlib.nullcontext
        self.merged_writes = 0  # writes that took more than one job (benchmarks read it)
        self.idle_s = idle_s
        self.name = name
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # jobs queued, workers idle
        self._issued_cv = threading.Condition(lock)  # writes issued (``wait_issued``): wakes no idle worker
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._closed = False
        # Jobs handed in, and jobs whose write was issued (launched, written, failed or dropped): a caller that
        # shares the device's stream with the copies waits until its jobs are issued (``wait_issued``).
        self._submitted = 0
        self._issued = 0

    def submit(self, job: TransferJob) -> None:
        """Queues ``job`` on its peer's worker for its room (never blocks)."""
        lane = (job.peer, hash(job.room) % self.per_peer)
        with self._cv:
            if self._closed:
                return  # the manager failed every room when it closed
            worker = self._workers.get(lane)
            if worker is None:
                worker = self._workers[lane] = _Worker()
                worker.thread = threading.Thread(target=self._run, args=(lane, worker), daemon=True,
                                                 name=f"{self.name}-{job.peer}-{lane[1]}")
                worker.thread.start()
            worker.jobs.append(job)
            self._submitted += 1
            self._cv.notify_all()

    def wait_issued(self, timeout_s: float) -> bool:
        """Waits until every job submitted before this call has its write issued (a copy queued on the device
        is issued); False if ``timeout_s`` passed first."""
        with self._cv:
            target = self._submitted
            return self._issued_cv.wait_for(lambda: self._issued >= target or self._closed, timeout=timeout_s)

    def _count_issued(self, jobs: int) -> None:
        with self._cv:
            self._issued += jobs
            self._issued_cv.notify_all()

    @property
    def threads(self) -> int:
        """Workers alive now (tests check it returns to zero)."""
        with self._cv:
            return len(self._workers)

    def close(self, timeout_s: float = 2.0) -> None:
        """Drops queued jobs and joins the workers (one stuck in Mooncake is left, logged)."""
        with self._cv:
            self._closed = True
            workers = list(self._workers.values())
            for worker in workers:
                self._issued += len(worker.jobs)
                worker.jobs.clear()
            self._cv.notify_all()
            self._issued_cv.notify_all()
        for worker in workers:
            assert worker.thread is not None
            worker.thread.join(timeout=timeout_s)
            if worker.thread.is_alive():
                log.warning("%s still running at close (blocked in Mooncake?)", worker.thread.name)

    def _run(self, lane: tuple[str, int], worker: _Worker) -> None:
        while True:
            with self._cv:
                if not worker.jobs and not self._closed:
                    self._cv.wait_for(lambda: worker.jobs or self._closed, timeout=self.idle_s)
                if not worker.jobs:  # idle for idle_s, or closing: this lane's next job starts a new worker
                    del self._workers[lane]
                    return
                job = worker.jobs.popleft()
                batch = [job]
                if job.merge is not None and self.write is not None:
                    while worker.jobs and worker.jobs[0].merge is not None and len(batch) < MAX_MERGED_JOBS:
                        batch.append(worker.jobs.popleft())
            if len(batch) == 1 and (job.merge is None or self.write is None or self.launch_pages is None):
                try:
                    self._run_one(job)
                finally:
                    self._count_issued(1)
            else:
                try:
                    self._run_merged(batch, worker)
                except Exception:  # a bug past the jobs' own handling: the lane must live on for its next jobs
                    log.exception("a merged write of %d jobs to %s failed outside its rooms' handling", len(batch),
                                  lane[0])

    @staticmethod
    def _run_one(job: TransferJob) -> None:
        try:
            job.run()
        except Exception as exc:
            log.exception("transfer job of room %d to %s failed", job.room, job.peer)
            PeerWorkers._fail(job, exc)

    @staticmethod
    def _fail(job: TransferJob, exc: Exception) -> None:
        try:
            job.fail(exc)
        except Exception:
            log.exception("failing room %d after its job raised failed too", job.room)

    def _run_merged(self, batch: list[TransferJob], worker: _Worker | None = None) -> None:
        """Prepares the jobs' writes and makes one write per peer session of them: for whole pages where the
        transport takes runs, ``PIPELINE_JOBS`` jobs at a time, each part's copy launched before the previous
        part is waited for and finished; otherwise all of them, written at once. The last part's rooms are
        told they are last when ``worker`` has nothing queued after them."""
        assert self.write is not None
        step = PIPELINE_JOBS if self.launch_pages is not None else len(batch)
        in_flight: collections.deque[tuple[Prepared, Callable[[], int] | None, Exception | None]] = collections.deque()
        issued = 0
        try:
            for start in range(0, len(batch), step):
                for session, group in self._prepare(batch[start:start + step]).items():
                    if len(group) > 1:
                        self.merged_writes += 1
                    writes = [w for _, w in group]
                    runs = _page_runs_of(writes) if self.launch_pages is not None else None
                    if runs is None:
                        while in_flight:  # jobs finish in queue order
                            self._land(*in_flight.popleft())
                        self._finish(group, *self._write_segments(session, writes))
                        continue
                    try:
                        in_flight.append((group, self.launch_pages(session, runs), None))  # type: ignore[misc]
                    except Exception as exc:
                        log.exception("a merged write of %d rooms to %s failed", len(group), session)
                        in_flight.append((group, None, exc))
                jobs = min(step, len(batch) - start)
                self._count_issued(jobs)  # this part's copies are queued (or written, or failed)
                issued += jobs
                while len(in_flight) > 1:  # the copy just launched runs while the one before it is finished
                    self._land(*in_flight.popleft())
        finally:
            if issued < len(batch):  # a part raised before it was counted
                self._count_issued(len(batch) - issued)
            while in_flight:
                part = in_flight.popleft()
                self._land(*part, last=not in_flight and not (worker is not None and worker.jobs))

    def _prepare(self, jobs: list[TransferJob]) -> dict[str, Prepared]:
        by_session: dict[str, Prepared] = {}
        for job in jobs:
            assert job.merge is not None
            try:
                prepared = job.merge()
            except Exception as exc:
                log.exception("preparing the write of room %d to %s failed", job.room, job.peer)
                self._fail(job, exc)
                continue
            if prepared is not None:
                by_session.setdefault(prepared.session, []).append((job, prepared))
        return by_session

    def _write_segments(self, session: str, writes: list[MergeableWrite]) -> tuple[int | None, Exception | None]:
        assert self.write is not None
        try:
            segments = _segments_of(writes)
            return self.write(session, segments.srcs, segments.dsts, segments.lens), None
        except Exception as exc:
            log.exception("a merged write of %d rooms to %s failed", len(writes), session)
            return None, exc

    def _land(self, group: Prepared, landed: Callable[[], int] | None, error: Exception | None,
              last: bool = False) -> None:
        """Waits for a launched copy (``landed``; or its launch's ``error``), then finishes its jobs."""
        code: int | None = None
        if landed is not None:
            try:
                code = landed()
            except Exception as exc:
                log.exception("a merged write of %d rooms failed", len(group))
                error = exc
        self._finish(group, code, error, last)

    def _finish(self, group: Prepared, code: int | None, error: Exception | None, last: bool = False) -> None:
        """Hands the jobs the write's ``code`` in queue order (a run of writes sharing ``finish`` in one call);
        ``last``: nothing else is queued or in flight here, so their Success messages need not wait behind
        anything (the manager may send them from this thread)."""
        with self.finish_together(last):
            i = 0
            while i < len(group):
                finish = group[i][1].finish
                if finish is None:
                    failures: list[Exception | None] = [None]
                    try:
                        group[i][1].done(code)  # type: ignore[misc]
                    except Exception as exc:
                        failures[0] = exc
                    end = i + 1
                else:
                    end = i + 1
                    while end < len(group) and group[end][1].finish is finish:
                        end += 1
                    try:
                        failures = finish([w for _, w in group[i:end]], code)
                    except Exception as exc:
                        failures = [exc] * (end - i)
                for (job, _), exc in zip(group[i:end], failures, strict=True):
                    if exc is not None:
                        log.error("finishing the write of room %d failed", job.room, exc_info=exc)
                        self._fail(job, exc)
                    elif error is not None:
                        self._fail(job, error)
                i = end
