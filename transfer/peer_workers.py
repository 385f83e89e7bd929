"""Worker threads per peer: a peer whose Mooncake calls block (30-60 s on a frozen or
blackholing host) holds only its own workers, never another peer's rooms.

Workers start on a peer's first job and end after ``idle_s`` without one, so the thread count
returns to its start once the peers go away (a worker stuck in a call to a dead peer ends when
the call returns). One room's jobs to one peer always go to the same worker, in order. A job
that raises fails its own room (``TransferJob.fail``); the worker carries on.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferJob:
    """Writes of one chunk of one room to one peer; ``run`` does the I/O, off the manager's lock;
    ``fail`` is called with the exception if ``run`` raises."""

    peer: str
    room: int
    run: Callable[[], None]
    fail: Callable[[Exception], None]


class _Worker:
    def __init__(self) -> None:
        self.jobs: collections.deque[TransferJob] = collections.deque()
        self.thread: threading.Thread | None = None


class PeerWorkers:
    """``per_peer`` worker threads for each peer, started on demand, gone after ``idle_s`` idle."""

    def __init__(self, per_peer: int, idle_s: float, name: str = "transfer-worker") -> None:
        self.per_peer = per_peer
        self.idle_s = idle_s
        self.name = name
        self._cv = threading.Condition()
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._closed = False

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
            self._cv.notify_all()

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
                worker.jobs.clear()
            self._cv.notify_all()
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
            try:
                job.run()
            except Exception as exc:
                log.exception("transfer job of room %d to %s failed", job.room, job.peer)
                try:
                    job.fail(exc)
                except Exception:
                    log.exception("failing room %d after its job raised failed too", job.room)
