"""KV transfers of a tensor-parallel replica: rank 0's role drives them, every rank moves its heads.

Each rank registers its own KV pool (its heads) with its own transfer manager, and holds its own
sender or receiver for every room. Rank 0's role calls a `ReplicatedRoom`: each state-changing
call (init, send, send_metadata, abort, clear) runs on rank 0's room and is queued as an
operation that the worker ranks repeat on theirs (engine/roles/rank_transfers.py), in order,
before their next message. Poll states are agreed: every rank polls the same rooms in the same
order and all take the element-wise MIN (all-reduce over the gloo control group), so a room is
Success only when it succeeded on every rank, and all ranks act on it in the same round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.engine.tp.step_broadcast import StepBroadcaster
from splitserve.transfer import KVPoll, agree_poll_states

# What a worker may be asked to repeat, by method name.
REPLAYED_METHODS = frozenset({"init", "send", "send_metadata", "abort", "clear"})


def new_room_op(rid: str, kind: str, bootstrap_addr: str, room: int) -> tuple:
    return ("new", rid, kind, bootstrap_addr, room)


def call_op(rid: str, method: str, args: tuple, kwargs: dict[str, Any]) -> tuple:
    if method not in REPLAYED_METHODS:
        raise ValueError(f"{method!r} is not a replayed transfer call ({sorted(REPLAYED_METHODS)})")
    return ("call", rid, method, args, kwargs)


class ReplicatedRoom:
    """A sender or receiver on rank 0 whose state-changing calls every other rank repeats.

    Reads (`poll`, `failure_exception`) are this rank's own; the role uses `agree` on the
    endpoint for the replica's state.
    """

    def __init__(self, local: Any, rid: str, broadcaster: StepBroadcaster) -> None:
        self.local = local
        self.rid = rid
        self.broadcaster = broadcaster

    def init(self, *args: Any, **kwargs: Any) -> None:
        self._call("init", args, kwargs)

    def send(self, *args: Any, **kwargs: Any) -> None:
        self._call("send", args, kwargs)

    def send_metadata(self, *args: Any, **kwargs: Any) -> None:
        self._call("send_metadata", args, kwargs)

    def abort(self, *args: Any, **kwargs: Any) -> None:
        self._call("abort", args, kwargs)

    def clear(self) -> None:
        self._call("clear", (), {})

    def poll(self) -> KVPoll:
        return self.local.poll()

    @property
    def succeeded_at(self) -> float | None:
        return self.local.succeeded_at

    def no_write_can_land(self) -> bool:
        # Rank 0's fence waits on every prefill rank of the replica, and a prefill rank's answer
        # covers its writes to every decode rank: it speaks for the whole replica.
        return self.local.no_write_can_land()

    def failure_exception(self) -> Exception | None:
        exc = self.local.failure_exception()
        if exc is None and self.local.poll() != KVPoll.Failed:
            return RuntimeError(f"the transfer of request {self.rid} failed on another tensor-parallel rank "
                                "(its log says why)")
        return exc

    def _call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        getattr(self.local, method)(*args, **kwargs)
        # Page lists may be views of the request's own list: send a copy, not a reference.
        self.broadcaster.queue_op(call_op(self.rid, method, tuple(_frozen(a) for a in args),
                                          {k: _frozen(v) for k, v in kwargs.items()}))


def _frozen(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def agree_over_ranks(rids: Sequence[str], rooms: Sequence[Any], broadcaster: StepBroadcaster | None) -> list[KVPoll]:
    """The replica's state of each room: the MIN over ranks (this rank's own poll at TP 1)."""
    if broadcaster is None or not rooms:
        return [room.poll() for room in rooms]
    broadcaster.poll(list(rids))  # the workers poll the same rooms, in this order, then all-reduce
    return agree_poll_states([int(room.poll()) for room in rooms], broadcaster.control)
