"""One room's state, its failure and its deadline: the part both sides share.

Not thread-safe by itself: the manager's lock guards it.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.transfer.errors import KVTimeoutError, KVTransferError
from splitserve.transfer.poll_state import KVPoll


class RoomStatus:
    """State machine of one room: forward-only moves, a deadline per non-final state.

    ``on_change(self)`` is called after every state change (the manager wakes whoever waits on rooms)."""

    def __init__(self, room: int, timeouts: dict[KVPoll, float], now: float,
                 on_change: Callable[[RoomStatus], None] | None = None) -> None:
        self.room = room
        self._timeouts = timeouts
        self._on_change = on_change
        self.state = KVPoll.Bootstrapping
        self.final = False  # is_final(self.state), kept with it (read several times per room on the hot path)
        self.error: KVTransferError | None = None
        self.history: list[KVPoll] = [KVPoll.Bootstrapping]
        self.deadline = now + timeouts[KVPoll.Bootstrapping]
        self._window: tuple[float, float] | None = None  # (deadline, length) over every state

    def move(self, target: KVPoll, now: float) -> bool:
        """Moves forward to ``target`` (never to Failed: use ``fail``); True if it changed."""
        # advance(), inlined (every room moves 3-4 times, on the engine thread and the worker): a final state
        # stays, Failed is not a move, and only a state further along is.
        if self.final or target == KVPoll.Failed or target <= self.state:
            return False
        new = KVPoll(target)
        self.state = new
        self.final = new == KVPoll.Success
        self.history.append(new)
        if not self.final:
            self.deadline = now + self._timeouts[new]
        if self._on_change is not None:
            self._on_change(self)
        return True

    def touch(self, now: float) -> None:
        """Restarts the current state's deadline (progress was made)."""
        if not self.final:
            self.deadline = now + self._timeouts[self.state]

    def fail(self, error: KVTransferError) -> bool:
        """Fails the room with ``error`` unless it is already final; True if it failed now."""
        if self.final:
            return False
        self.state = KVPoll.Failed
        self.final = True
        self.error = error
        self.history.append(KVPoll.Failed)
        if self._on_change is not None:
            self._on_change(self)
        return True

    def cap(self, deadline: float, window_s: float) -> None:
        """The room must be final by ``deadline`` whatever its state (the write-by deadline)."""
        self._window = (deadline, window_s)

    def expired(self, now: float) -> KVTimeoutError | None:
        """The timeout error if the current state's deadline, or the room's cap, has passed."""
        if self.final:
            return None
        if self._window is not None and now > self._window[0]:
            return KVTimeoutError(self.room, f"{self.state.name} (write window)", self._window[1])
        if now <= self.deadline:
            return None
        return KVTimeoutError(self.room, self.state.name, self._timeouts[self.state])
