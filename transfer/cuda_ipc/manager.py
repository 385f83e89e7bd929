"""``CudaIpcKVManager``: the CUDA IPC backend, for prefill and decode processes on one host's GPUs.

Rooms, control messages, heartbeats and the bootstrap protocol are the Mooncake backend's
(``KVManager`` and its senders / receivers run unchanged on top of this manager); only
the data path differs: ``CudaIpcEngine`` (see cuda_ipc_engine.py) instead of Mooncake. Chosen by
``--transfer-protocol cuda_ipc``.

- Every rank exports its KV pool and aux allocations; its layout carries their IPC handles
  (``KVLayout.ipc_regions``), so the decode's layout (sent in its first ``KVMetadata`` to a prefill,
  named by its digest after that) tells the prefill where to write. The aux tensor must be in
  device memory too (``make_aux_tensor(..., device)``).
- The prefill learns a decode's regions from its metadata and maps them on the first write to
  it; they are unmapped when that peer is declared dead or restarted, once it has had no room
  for a heartbeat timeout (the next room maps it again), and at close.
- Segments go to the copy kernel in batches of up to ``IPC_BATCH_SEGMENTS``: a batch costs one
  launch and one wait, not a network round trip, so Mooncake TCP's small batches would only
  add waits; and every write goes through this manager's one engine (``transfer_writer_engines``
  0: the per-peer Mooncake engines guard a handshake this transport does not have).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import CollectorRegistry

from splitserve.transfer.config import TransferConfig
from splitserve.transfer.control_messages import KVMetadata
from splitserve.transfer.cuda_ipc.engine import CudaIpcEngine
from splitserve.transfer.errors import LayoutMismatchError
from splitserve.transfer.kv.layout import KVLayout
from splitserve.transfer.kv.manager import KVManager

IPC_BATCH_SEGMENTS = 1 << 20


class CudaIpcKVManager(KVManager):
    """The transfer side of one engine rank, moving KV by device copies into peers' mapped memory."""

    engine: CudaIpcEngine  # type: ignore[assignment]

    def __init__(self, config: TransferConfig, layout: KVLayout, *,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        # No writer engine per peer either: that guards against Mooncake's handshake mutex, and a copy
        # into a mapped pool has no handshake to freeze in.
        config = config.replace(transfer_max_batch_segments=max(config.transfer_max_batch_segments,
                                                                IPC_BATCH_SEGMENTS), transfer_writer_engines=0)
        self._peer_sessions: dict[str, str] = {}  # control endpoint -> the cuda_ipc session behind it
        super().__init__(config, layout, metrics_registry=metrics_registry)
        self.layout = dataclasses.replace(self.layout, ipc_regions=self.engine.regions)

    def _open_transport(self, config: TransferConfig) -> CudaIpcEngine:  # type: ignore[override]
        return CudaIpcEngine(config.transfer_host, own_stream=config.transfer_copy_stream)

    @property
    def copy_stream(self) -> Any:
        return self.engine.copy_stream

    def _on_metadata(self, msg: KVMetadata, now: float) -> None:
        try:
            session, regions = (layout := self.peer_layout(msg)).session, layout.ipc_regions
        except (ValueError, LayoutMismatchError):
            session = ""  # the sender fails the room with the reason
        if session:
            old = self._peer_sessions.get(msg.reply_to)
            if old != session:
                # One process per control endpoint: a new session there means the old one is gone
                # (restarted while no room was open, so no heartbeat noticed).
                if old is not None:
                    self.engine.forget(old)
                self._peer_sessions[msg.reply_to] = session
            self.engine.learn_peer(session, regions)
        super()._on_metadata(msg, now)

    def _forget_peer_sessions(self, endpoint: str) -> None:
        session = self._peer_sessions.pop(endpoint, None)
        if session is not None:
            self.engine.forget(session)

    def _on_tick(self, now: float) -> None:
        with self.lock:
            watched = set(self._peer_rooms)
            super()._on_tick(now)
            # A peer idle for a heartbeat timeout is no longer watched: unmap it too, so a decode that
            # went away while no room was open does not keep its pool alive in this process's mapping.
            for endpoint in watched - set(self._peer_rooms):
                self._forget_peer_sessions(endpoint)

    def _peer_dead(self, endpoint: str) -> None:
        super()._peer_dead(endpoint)
        self._forget_peer_sessions(endpoint)

    def _peer_restarted(self, endpoint: str, old: str, new: str) -> None:
        super()._peer_restarted(endpoint, old, new)
        self._forget_peer_sessions(endpoint)  # the new instance's metadata brings its own regions

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "mapped_peers": self.engine.mapped_peers}
