"""What a sender and a receiver share: reading, failing and forgetting one room under the manager's lock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from splitserve.transfer.errors import KVAbortedError, KVTransferError
from splitserve.transfer.poll_state import KVPoll

if TYPE_CHECKING:
    from splitserve.transfer.kv.manager import KVManager
    from splitserve.transfer.room_status import RoomStatus


class KVRoom:
    """One side of one room on the Mooncake backend; subclasses say how a failure is announced."""

    mgr: KVManager
    room: int
    status: RoomStatus

    def fail_locked(self, error: KVTransferError, notify: bool) -> None:
        raise NotImplementedError

    def poll(self) -> KVPoll:
        with self.mgr.lock:
            error = self.status.expired(time.monotonic())
            if error is not None:
                self.fail_locked(error, notify=True)
            return self.status.state

    def wait(self, timeout_s: float) -> KVPoll:
        """Blocks until the room is final or ``timeout_s`` passed; its state then (for callers with
        nothing else to do, like benchmarks: an engine polls)."""
        deadline = time.monotonic() + timeout_s
        with self.mgr.lock:
            while not self.status.final:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.mgr.wait_locked(min(left, 0.05))  # deadlines expire through poll(): look again
                error = self.status.expired(time.monotonic())
                if error is not None:
                    self.fail_locked(error, notify=True)
            return self.status.state

    def failure_exception(self) -> KVTransferError | None:
        return self.status.error

    def abort(self, reason: str = "") -> None:
        with self.mgr.lock:
            self.fail_locked(KVAbortedError(self.room, "local", reason), notify=True)

    def clear(self) -> None:
        with self.mgr.lock:
            if not self.status.final:
                self.fail_locked(KVAbortedError(self.room, "local", "cleared before it finished"), notify=True)
        self.mgr.remove_room(self)  # type: ignore[arg-type]

    @property
    def state_history(self) -> tuple[KVPoll, ...]:
        """Every state the room went through, in order (for tests and debugging)."""
        return tuple(self.status.history)
