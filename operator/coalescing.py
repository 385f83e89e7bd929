"""At most one reconcile per object at a time, with the triggers that arrive meanwhile folded into one.

A group gets an event for every change of every child (a StatefulSet's status, a role's status,
...). Reconciliation is level-based, so ten triggers while a reconcile runs need one more run,
not ten: the first trigger runs it, later ones only mark it to run again, and return at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

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
