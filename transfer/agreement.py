"""Replica-wide agreement on poll states: every TP rank acts on the same rooms in the same round.

Each rank polls its own sender/receiver for the same list of rooms (same order on every
rank), then all ranks take the element-wise minimum, so a room counts as Success only when
it succeeded on every rank, and as Failed as soon as it failed on any rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from splitserve.transfer.poll_state import KVPoll


class Pollable(Protocol):
    def poll(self) -> KVPoll: ...


def agree_poll_states(states: Sequence[int], group: dist.ProcessGroup | None = None) -> list[KVPoll]:
    """All-reduce MIN of ``states`` over ``group`` (gloo on CPU); local states without a group.

    Every rank of the group must call this with lists of the same length, in the same order.
    """
    if not states:
        return []
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [KVPoll(int(s)) for s in states]
    tensor = torch.tensor([int(s) for s in states], dtype=torch.int32)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(int(s)) for s in tensor.tolist()]


def poll_and_agree(rooms: Sequence[Pollable], group: dist.ProcessGroup | None = None) -> list[KVPoll]:
    """Polls every room here, then agrees with the other ranks (see ``agree_poll_states``)."""
    return agree_poll_states([room.poll() for room in rooms], group)
