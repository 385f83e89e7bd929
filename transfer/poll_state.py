"""The poll states both sides of a transfer expose, ordered so that "least advanced" is ``min``."""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    """State of one room. Moves only forward; ``Failed`` and ``Success`` are final."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def is_final(state: KVPoll) -> bool:
    """True for the states a room never leaves."""
    return state in (KVPoll.Failed, KVPoll.Success)


def advance(current: KVPoll, target: KVPoll) -> KVPoll:
    """The state after asking to move from ``current`` to ``target``.

    A final state never changes; ``Failed`` is reachable from any other state; any other
    target only takes effect when it is further along than ``current``.
    """
    if is_final(current):
        return current
    if target == KVPoll.Failed or target > current:
        return KVPoll(target)
    return current
