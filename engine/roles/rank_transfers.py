"""A worker rank's share of its replica's KV transfers: its own transfer manager over its own
heads, and its own sender or receiver per room, doing what rank 0's role did (see
engine/roles/replicated_transfers.py for the operations and the poll agreement)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.roles.kv_transfer_endpoint import aux_slot_count
from splitserve.engine.roles.replicated_transfers import REPLAYED_METHODS
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.tp.parallel_state import TensorParallel
from splitserve.transfer import (
    AuxWriter,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    agree_poll_states,
    aux_device,
    layout_for_pool,
    make_aux_tensor,
    new_kv_manager,
)

logger = logging.getLogger(__name__)

FINAL = (KVPoll.Success, KVPoll.Failed)


class RankTransferError(RuntimeError):
    """Rank 0 sent a transfer operation this rank cannot apply (a bug: the ranks disagree)."""


class RankTransfers:
    """Applies rank 0's transfer operations to this rank's rooms and polls them on request."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel, role: str, config: TransferConfig,
                 bootstrap_addr: str | None) -> None:
        self.device = runner.device
        self.aux = make_aux_tensor(aux_slot_count(runner.cfg), device=aux_device(config, runner.kv_pool.buffer.device))
        layout = layout_for_pool(runner.kv_pool.buffer, self.aux, tp_size=tp.size, tp_rank=tp.rank,
                                 num_kv_heads=runner.model_cfg.num_kv_heads, kv_scales=runner.kv_scales_digest)
        # Rank 0 holds any fixed control port; the other ranks take free ones.
        self.manager = new_kv_manager(dataclasses.replace(config, transfer_control_port=0), layout)
        self.aux_writer = AuxWriter(self.aux, stream=self.manager.copy_stream)
        if role == "prefill":
            if bootstrap_addr is None:
                raise RankTransferError("a prefill rank needs the replica's bootstrap address")
            self.manager.publish_layout(bootstrap_addr)
        self.rooms: dict[str, Any] = {}
        logger.info("rank %d: %s transfers ready (heads of rank %d/%d)", tp.rank, role, tp.rank, tp.size)

    def apply(self, ops: Sequence[tuple]) -> None:
        if self.device.type == "cuda" and any(op[0] == "call" and op[2] == "send" for op in ops):
            torch.cuda.synchronize(self.device)  # the KV a send reads was written by this rank's last step
        for op in ops:
            kind = op[0]
            if kind == "new":
                _, rid, room_kind, bootstrap_addr, room = op
                if rid in self.rooms:
                    raise RankTransferError(f"request {rid}: a second {room_kind} for room {room}")
                cls = KVSender if room_kind == "sender" else KVReceiver
                self.rooms[rid] = cls(self.manager, bootstrap_addr, room)
            elif kind == "call":
                _, rid, method, args, kwargs = op
                if method not in REPLAYED_METHODS:
                    raise RankTransferError(f"request {rid}: {method!r} is not a replayed transfer call")
                room = self.rooms.get(rid)
                if room is None and method in ("abort", "clear"):
                    continue  # cleared already: like the transfer layer's, clear() may be repeated
                if room is None:
                    raise RankTransferError(f"request {rid}: {method}() for a room this rank does not hold")
                if method == "abort" and room.poll() in FINAL:
                    continue  # rank 0 aborts what is not final there; here it may already be final
                getattr(room, method)(*args, **kwargs)
                if method == "clear":
                    del self.rooms[rid]
            elif kind == "aux":
                _, slot, data = op
                self.aux_writer.write(slot, data)
            else:
                raise RankTransferError(f"unknown transfer operation {kind!r}")

    def agree(self, rids: Sequence[str], control: dist.ProcessGroup) -> None:
        """This rank's side of rank 0's poll: same rooms, same order, then the MIN all-reduce."""
        states = [int(self.rooms[rid].poll()) if rid in self.rooms else int(KVPoll.Failed) for rid in rids]
        agree_poll_states(states, control)

    def close(self) -> None:
        for room in self.rooms.values():
            room.clear()
        self.rooms.clear()
        self.manager.close()
