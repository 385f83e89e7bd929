"""At most one reconcile per object at a time, with the triggers that arrive meanwhile folded into one.

A group gets an event for every change of every child (a StatefulSet's status, a role's status,
...). Reconciliation is level-based, so ten triggers while a reconcile runs need one more run,
not ten: the first trigger runs it, later ones only mark it to run again, and return at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

RUNNING, RERUN = "running", "rerun"


class Coalescer:
    """Runs ``work`` for a key unless it is already running; then asks that run to go once more."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._state: dict[Hashable, str] = {}

    def run(self, key: Hashable, work: Callable[[], None]) -> bool:
        """Runs ``work`` (again, while triggers came during it); False if it was folded into a running one."""
        with self._guard:
            if key in self._state:
                self._state[key] = RERUN
                return False
            self._state[key] = RUNNING
        try:
            while True:
                work()
                with self._guard:
                    if self._state[key] != RERUN:
                        del self._state[key]
                        return True
                    self._state[key] = RUNNING
        except BaseException:
            with self._guard:
                self._state.pop(key, None)
            raise

    def busy(self) -> int:
        """How many keys are being reconciled now."""
        with self._guard:
            return len(self._state)


class Dispatcher:
    """Runs triggered work on a pool of threads; a key already waiting for a thread is not queued again.

    The watch threads of the child caches must not block on a reconcile: they hand the owner's key
    here. A burst of events for one owner then queues one task (plus, through the
    :class:`Coalescer` inside the work, at most one rerun of a reconcile already running).
    """

    def __init__(self, workers: int, name: str = "reconcile") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._guard = threading.Lock()
        self._waiting: set[Hashable] = set()

    def submit(self, key: Hashable, work: Callable[[], None]) -> bool:
        """Queues ``work`` unless ``key`` already waits; False when it did."""
        with self._guard:
            if key in self._waiting:
                return False
            self._waiting.add(key)
        self._pool.submit(self._run, key, work)
        return True

    def _run(self, key: Hashable, work: Callable[[], None]) -> None:
        with self._guard:
            self._waiting.discard(key)
        try:
            work()
        except Exception:
            log.exception("triggered work for %s failed", key)

    def waiting(self) -> int:
        """How many keys wait for a thread."""
        with self._guard:
            return len(self._waiting)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
