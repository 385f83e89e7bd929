"""``KVReceiver``: the decode side of one room.

Lifecycle: Bootstrapping (looking the prefill's layout up, then waiting for
``send_metadata``) -> WaitingForInput (metadata sent to every prefill rank it pulls heads
from) -> Transferring (a prefill rank reported progress) -> Success (every such prefill rank
reported Success, so every page and the aux slot landed) or Failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from splitserve.transfer.contract import BaseKVReceiver
from splitserve.transfer.control_messages import AbortRoom, KVMetadata, TransferStatus
from splitserve.transfer.errors import (
    KVMetadataError,
    KVPeerFailedError,
    KVTransferError,
    LayoutMismatchError,
    TransferUsageError,
)
from splitserve.transfer.kv.layout import HeadSource, KVLayout, decode_ranks_per_prefill_rank, head_sources
from splitserve.transfer.kv.manager import KVManager
from splitserve.transfer.kv.room import KVRoom
from splitserve.transfer.poll_state import KVPoll
from splitserve.transfer.room_status import RoomStatus
from splitserve.transfer.write_fence import WriteFence

log = logging.getLogger(__name__)


class KVReceiver(KVRoom, BaseKVReceiver):
    """Decode side of room ``room`` of the prefill replica at ``bootstrap_addr`` (``host:port``)."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, room: int) -> None:
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        now = time.monotonic()
        self.status = RoomStatus(room, mgr.receiver_timeouts, now, mgr.room_changed_locked)
        self._created = now
        self._started = False
        self._prefill: list[KVLayout] | None = None
        self._sources: list[HeadSource] = []
        self._expected: list[int] = []
        self._metadata: tuple[list[int], int, int] | None = None
        self._metadata_sent_at: float | None = None
        self._write_by: float | None = None  # monotonic; the wall-clock one went out in the metadata
        self._fence: WriteFence | None = None
        self._succeeded_ranks: set[int] = set()
        self._recorded = False
        mgr.add_receiver(self)

    # ----------------------------------------------------------- engine API

    def init(self) -> None:
        with self.mgr.lock:
            if self._started:
                raise TransferUsageError(f"room {self.room}: init called twice")
            self._started = True
            self.status.touch(time.monotonic())
        self.mgr.request_layouts(self)

    def send_metadata(self, kv_page_indices: Sequence[int], aux_index: int, decode_prefix_len: int = 0) -> None:
        local = self.mgr.layout
        pages = [int(p) for p in kv_page_indices]
        if any(p < 0 or p >= local.num_pages for p in pages):
            raise TransferUsageError(f"room {self.room}: page index outside 0..{local.num_pages - 1}")
        if not 0 <= aux_index < local.aux.num_slots:
            raise TransferUsageError(f"room {self.room}: aux_index {aux_index} outside 0..{local.aux.num_slots - 1}")
        if not 0 <= decode_prefix_len <= len(pages) * local.page_size:
            raise TransferUsageError(f"room {self.room}: decode_prefix_len {decode_prefix_len} outside "
                                     f"0..{len(pages) * local.page_size}")
        with self.mgr.lock:
            if not self._started:
                raise TransferUsageError(f"room {self.room}: send_metadata before init")
            if self._metadata is not None:
                raise TransferUsageError(f"room {self.room}: send_metadata called twice")
            self._metadata = (pages, aux_index, decode_prefix_len)
            if self._prefill is not None and not self.status.final:
                self._send_metadata_locked(time.monotonic())

    # ------------------------------------------------------ manager callbacks

    @property
    def waiting_for_layouts(self) -> bool:
        return self._started and self._prefill is None and not self.status.final

    def peer_instance(self, endpoint: str) -> str:
        if self._prefill is None:
            return ""
        return next((lay.instance_id for lay in self._prefill if lay.control_endpoint == endpoint), "")

    def on_layouts_locked(self, layouts: list[KVLayout], now: float) -> None:
        """The prefill's layouts are known (manager lock held)."""
        if self._prefill is not None:
            return
        self._prefill = layouts
        local = self.mgr.layout
        try:
            for lay in layouts:
                local.check_compatible(lay, f"decode rank {local.tp_rank} vs prefill rank {lay.tp_rank}")
            self._sources = head_sources(len(layouts), local.num_kv_heads, local.head_start, local.head_count)
            self._expected = decode_ranks_per_prefill_rank(len(layouts), local.tp_size, local.num_kv_heads)
        except (LayoutMismatchError, ValueError) as exc:
            self.fail_locked(KVMetadataError(self.room, str(exc)), notify=False)
            # The prefill ranks wait for this room's metadata, which never comes: told why now (a KV dtype or
            # page layout the two sides do not share), they fail the room and free its pages at once instead
            # of at their bootstrap timeout.
            for lay in layouts:
                self.mgr.send(lay.control_endpoint, AbortRoom(self.room, self.bootstrap_addr, self.mgr.endpoint,
                                                              self.mgr.instance_id, str(exc)))
            return
        if self.status.final:
            # Aborted before the layout was known: tell the prefill ranks now.
            if self.status.state == KVPoll.Failed:
                self._notify_sources(str(self.status.error))
            return
        for src in self._sources:
            lay = layouts[src.prefill_rank]
            self.mgr.attach_peer(self, lay.control_endpoint, lay.instance_id)
        if self._metadata is not None:
            self._send_metadata_locked(now)

    def on_status_locked(self, msg: TransferStatus, now: float) -> None:
        """A prefill rank reported on this room (manager lock held)."""
        if self.status.final:
            return
        if msg.state == KVPoll.Failed:
            self.mgr.layout_lost(msg.reply_to)  # perhaps it lacked our layout: the next room carries it
            self.fail_locked(KVPeerFailedError(self.room, msg.reply_to, msg.reason), notify=False)
        elif msg.state == KVPoll.Transferring:
            self.status.move(KVPoll.Transferring, now)
            self.status.touch(now)
        elif msg.state == KVPoll.Success:
            self.on_success_locked(msg.prefill_rank, now)

    def on_success_locked(self, prefill_rank: int, now: float) -> None:
        """Prefill rank ``prefill_rank`` wrote every page of this room and its aux slot (manager lock held)."""
        if self.status.final:
            return
        self._succeeded_ranks.add(prefill_rank)
        self.status.move(KVPoll.Transferring, now)
        sources = self._sources
        if (len(sources) == 1 and sources[0].prefill_rank == prefill_rank) or \
                {s.prefill_rank for s in sources} <= self._succeeded_ranks:
            self.status.move(KVPoll.Success, now)
            self._record(True)
        else:
            self.status.touch(now)

    def fail_locked(self, error: KVTransferError, notify: bool) -> None:
        """Fails the room (manager lock held) and, if ``notify``, tells the prefill ranks; once
        the metadata went out, the room's pages are fenced (write_fence.py)."""
        if not self.status.fail(error):
            return
        log.info("receiver room %d (%s) failed: %s", self.room, self.bootstrap_addr, error)
        if notify:
            self._notify_sources(str(error))
        if self._write_by is not None and self._prefill is not None:
            self._fence = self.mgr.fence_locked(self.room, self.bootstrap_addr, self._prefill, self._write_by)
        self._record(False)

    def no_write_can_land(self) -> bool:
        with self.mgr.lock:
            if self._write_by is None or self.status.state == KVPoll.Success:
                return True
            if not self.status.final:
                return False
        return self._fence is None or self.mgr.fence_lifted(self._fence)

    # --------------------------------------------------------------- internals

    def _notify_sources(self, reason: str) -> None:
        if self._prefill is None:
            return
        for src in self._sources:
            self.mgr.send(self._prefill[src.prefill_rank].control_endpoint,
                          AbortRoom(self.room, self.bootstrap_addr, self.mgr.endpoint, self.mgr.instance_id, reason))

    def _send_metadata_locked(self, now: float) -> None:
        assert self._prefill is not None and self._metadata is not None
        pages, aux_index, prefix_len = self._metadata
        local = self.mgr.layout
        layout_dict, digest = self.mgr.layout_dict()
        window = self.mgr.config.transfer_write_window_s
        write_by = time.time() + window
        self._write_by = now + window
        self.status.cap(self._write_by, window)
        for i, src in enumerate(self._sources):
            lay = self._prefill[src.prefill_rank]
            self.mgr.send(lay.control_endpoint, KVMetadata(
                room=self.room, bootstrap_addr=self.bootstrap_addr, reply_to=self.mgr.endpoint,
                instance=self.mgr.instance_id, decode_rank=local.tp_rank,
                expected_dsts=self._expected[src.prefill_rank],
                dst_layout=layout_dict if self.mgr.layout_due(lay.control_endpoint, lay.instance_id) else {},
                dst_layout_digest=digest, dst_pages=pages,
                dst_aux_index=aux_index, decode_prefix_len=prefix_len, head_start=src.head_start,
                head_count=src.head_count, write_aux=i == 0, write_by=write_by,
            ))
        self._metadata_sent_at = now
        self.status.move(KVPoll.WaitingForInput, now)

    def _record(self, success: bool) -> None:
        if self._recorded:
            return
        self._recorded = True
        now = time.monotonic()
        latency = now - self._metadata_sent_at if self._metadata_sent_at is not None else None
        wait = self._metadata_sent_at - self._created if self._metadata_sent_at is not None else None
        nbytes = 0
        if success and self._metadata is not None:
            pages, _, prefix_len = self._metadata
            local = self.mgr.layout
            nbytes = (len(pages) * local.page_size - prefix_len) * local.token_bytes * len(local.buffers)
        self.mgr.metrics.room_done("receiver", success, nbytes, latency, wait)
