"""What prefill and decode both need to move KV: the aux slots, the layout, the manager, and
(with tensor parallelism) the replication of every transfer call to the other ranks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.roles.replicated_transfers import ReplicatedRoom, agree_over_ranks, new_room_op
from splitserve.transfer import (
    AuxData,
    AuxReader,
    AuxWriter,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    aux_device,
    layout_for_pool,
    make_aux_tensor,
    new_kv_manager,
)

if TYPE_CHECKING:
    from splitserve.engine.engine import Engine

logger = logging.getLogger(__name__)

HANDED_OVER = "kv_transfer_endpoint"  # its name among what a role hands over on a switch (engine/role.py)


def aux_slot_count(cfg: EngineConfig) -> int:
    """Aux slots per rank: decode indexes them by batch slot; prefill gives one to each request from
    its arrival on (it waits for its decode before it has a batch slot)."""
    return cfg.max_running_requests + cfg.max_waiting_requests


class KVTransferEndpoint:
    """Registers an engine's KV pool and one aux slot per request slot with the transfer layer.

    Rooms are made here (`new_sender`, `new_receiver`) so that, on a tensor-parallel engine,
    the other ranks make theirs too; `agree` is the replica's poll state of a list of rooms.
    A role switch hands it to the next role: it holds nothing of a prefill's or a decode's own but
    `role_name`, which only tensor-parallel ranks read (their engines do not switch).
    """

    def __init__(self, engine: Engine, config: TransferConfig) -> None:
        pool = engine.runner.kv_pool.buffer
        self.aux = make_aux_tensor(aux_slot_count(engine.cfg), device=aux_device(config, pool.device))
        self.aux_reader = AuxReader(self.aux)  # on a GPU: read on a side stream, nor does it wait to read
        if pool.device.type != "cpu" and config.transfer_protocol == "tcp":
            logger.warning("KV pool on %s with the tcp transport: Mooncake TCP stages GPU memory through "
                           "the host; use rdma in production", pool.device)
        layout = layout_for_pool(pool, self.aux, tp_size=engine.runner.tp.size, tp_rank=engine.runner.tp.rank,
                                 num_kv_heads=engine.model_cfg.num_kv_heads, kv_scales=engine.runner.kv_scales_digest)
        self.manager = new_kv_manager(config, layout, metrics_registry=engine.metrics.registry)
        # On a GPU: queued on the stream the copies that read it run on; the engine thread does not wait.
        self.aux_writer = AuxWriter(self.aux, stream=self.manager.copy_stream)
        self.manager.add_state_listener(lambda _room, _state: engine.wake())  # an idle loop wakes at once
        self.config = config
        self.role_name = engine.cfg.role
        self.supervisor = engine.tp_supervisor
        self.broadcaster = self.supervisor.broadcaster if self.supervisor is not None else None

    def start_worker_ranks(self, bootstrap_addr: str | None) -> None:
        """Has every other tensor-parallel rank register its own KV (and, on prefill, publish
        its layout to this replica's bootstrap server). A no-op at TP 1."""
        if self.broadcaster is not None:
            self.broadcaster.queue_op(("setup", self.role_name, self.config, bootstrap_addr))

    def new_sender(self, rid: str, bootstrap_addr: str, room: int) -> Any:
        return self._replicated(KVSender(self.manager, bootstrap_addr, room), rid, "sender", bootstrap_addr, room)

    def new_receiver(self, rid: str, bootstrap_addr: str, room: int) -> Any:
        return self._replicated(KVReceiver(self.manager, bootstrap_addr, room), rid, "receiver",
                                bootstrap_addr, room)

    def pack_aux(self, slot: int, data: AuxData) -> None:
        """Writes a request's aux data on every rank (any prefill rank may be the one that sends it)."""
        self.aux_writer.write(slot, data)
        if self.broadcaster is not None:
            self.broadcaster.queue_op(("aux", slot, data))

    def agree(self, rids: list[str], rooms: list[Any]) -> list[KVPoll]:
        """The replica's poll state of each room; all Failed once the ranks cannot agree any more."""
        if self.supervisor is not None and self.supervisor.failure is not None:
            return [KVPoll.Failed] * len(rooms)
        try:
            return agree_over_ranks(rids, rooms, self.broadcaster)
        except RuntimeError as exc:  # a rank died or hung mid-collective: the group is broken for good
            if self.supervisor is None:
                raise
            logger.error("transfer poll agreement failed: %s", self.supervisor.collective_failed(exc))
            return [KVPoll.Failed] * len(rooms)

    def _replicated(self, local: Any, rid: str, kind: str, bootstrap_addr: str, room: int) -> Any:
        if self.broadcaster is None:
            return local
        self.broadcaster.queue_op(new_room_op(rid, kind, bootstrap_addr, room))
        return ReplicatedRoom(local, rid, self.broadcaster)

    @property
    def session(self) -> str:
        """The Mooncake session (host:port) peers write this engine's KV through."""
        return self.manager.layout.session

    def close(self) -> None:
        self.manager.close()
