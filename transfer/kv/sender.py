"""``KVSender``: the prefill side of one room.

Lifecycle: Bootstrapping (waiting for every decode rank's ``KVMetadata``) -> WaitingForInput
(metadata in hand, ``init`` called) -> Transferring (a chunk was queued) -> Success (every
chunk and the aux slot written to every decode rank; Mooncake's synchronous write returns once
the peer acknowledged the bytes) or Failed.

Chunks sent before the metadata arrives wait in the room and go out when it does. Each
chunk becomes one job per decode rank on that rank's worker thread; the worker writes it
with Mooncake (off the manager's lock), then tells the decode rank: ``Transferring`` with the
pages done, or ``Success`` after the last chunk and the aux slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.transfer.contract import BaseKVSender
from splitserve.transfer.control_messages import AbortRoom, KVMetadata, TransferStatus
from splitserve.transfer.errors import (
    KVAbortedError,
    KVLengthMismatchError,
    KVMetadataError,
    KVTransferError,
    KVWorkerError,
    KVWriteError,
    LayoutMismatchError,
    TransferUsageError,
)
from splitserve.transfer.kv.layout import KVLayout
from splitserve.transfer.kv.manager import KVManager
from splitserve.transfer.kv.plan import EMPTY, PageCopy, Segments, aux_segment, concat, page_segments
from splitserve.transfer.kv.room import KVRoom
from splitserve.transfer.peer_workers import MergeableWrite, TransferJob
from splitserve.transfer.poll_state import KVPoll
from splitserve.transfer.room_status import RoomStatus

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: made once a room on the hot path (a frozen init costs ~3x)
class Chunk:
    """Pages ``[start, start + len(pages))`` of the prompt, held in local ``pages``."""

    index: int
    start: int
    pages: np.ndarray
    last: bool


@dataclass
class Destination:
    """One decode rank this room writes to."""

    meta: KVMetadata
    layout: KVLayout
    dst_pages: np.ndarray
    chunks_done: int = 0
    pages_done: int = 0  # the prompt pages of its chunks_done chunks
    bytes_done: int = 0
    done: bool = False
    announced: bool = field(default=False)


class KVSender(KVRoom, BaseKVSender):
    """Prefill side of room ``room``; ``bootstrap_addr`` is this prefill's bootstrap server."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, room: int) -> None:
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        now = time.monotonic()
        self.status = RoomStatus(room, mgr.sender_timeouts, now, mgr.room_changed_locked)
        self._created = now
        self._ready_at: float | None = None
        self._first_send_at: float | None = None
        self._num_pages: int | None = None
        self._aux_index = 0
        self._chunks: list[Chunk] = []
        self._pages_queued = 0
        self._dsts: dict[tuple[str, int], Destination] = {}
        self._expected_dsts: int | None = None
        self._recorded = False
        self.succeeded_at: float | None = None  # wall-clock seconds of Success (phase timing compares hosts)
        mgr.add_sender(self)

    # ----------------------------------------------------------- engine API

    def init(self, num_kv_pages: int, aux_index: int) -> None:
        local = self.mgr.layout
        if num_kv_pages < 0 or num_kv_pages > local.num_pages:
            raise TransferUsageError(f"room {self.room}: num_kv_pages {num_kv_pages} outside 0..{local.num_pages}")
        if not 0 <= aux_index < local.aux.num_slots:
            raise TransferUsageError(f"room {self.room}: aux_index {aux_index} outside 0..{local.aux.num_slots - 1}")
        with self.mgr.lock:
            if self._num_pages is not None:
                raise TransferUsageError(f"room {self.room}: init called twice")
            self._num_pages = num_kv_pages
            self._aux_index = aux_index
            self._maybe_ready(time.monotonic())

    def send(self, kv_page_indices: Sequence[int], last_chunk: bool) -> None:
        local_pages = self.mgr.layout.num_pages
        if isinstance(kv_page_indices, np.ndarray):
            pages = kv_page_indices.astype(np.int64, copy=False)
            lo, hi = (int(pages.min()), int(pages.max())) if len(pages) else (0, 0)
        else:  # a list (the engine's): Python's min / max over a room's pages cost less than numpy's calls
            indices = list(kv_page_indices)
            lo, hi = (min(indices), max(indices)) if indices else (0, 0)
            pages = np.array(indices, dtype=np.int64)
        if len(pages) and (lo < 0 or hi >= local_pages):
            raise TransferUsageError(f"room {self.room}: page index outside 0..{local_pages - 1}")
        with self.mgr.lock:
            if self._num_pages is None:
                raise TransferUsageError(f"room {self.room}: send before init")
            if self._chunks and self._chunks[-1].last:
                raise TransferUsageError(f"room {self.room}: send after the last chunk")
            if self.status.final:
                return
            total = self._pages_queued + len(pages)
            if total > self._num_pages or (last_chunk and total != self._num_pages):
                self.fail_locked(KVLengthMismatchError(self.room, "prefill pages sent", self._num_pages, total),
                                 notify=True)
                return
            chunk = Chunk(len(self._chunks), self._pages_queued, pages, last_chunk)
            self._chunks.append(chunk)
            self._pages_queued = total
            if self.status.state >= KVPoll.WaitingForInput:
                self._dispatch(chunk, time.monotonic())

    # ------------------------------------------------------ manager callbacks

    def has_peer(self, endpoint: str) -> bool:
        return any(ep == endpoint for ep, _ in self._dsts)

    def peer_instance(self, endpoint: str) -> str:
        return next((d.meta.instance for (ep, _), d in self._dsts.items() if ep == endpoint), "")

    def on_metadata_locked(self, msg: KVMetadata, now: float) -> None:
        """A decode rank's metadata arrived (manager lock held)."""
        if self.status.final:
            if self.status.state == KVPoll.Failed:
                reason = str(self.status.error)
                self.mgr.send(msg.reply_to, AbortRoom(self.room, msg.bootstrap_addr, self.mgr.endpoint,
                                                      self.mgr.instance_id, reason))
            return
        key = (msg.reply_to, msg.decode_rank)
        self.mgr.attach_peer(self, msg.reply_to, msg.instance)
        if key in self._dsts:
            self.fail_locked(KVMetadataError(self.room, f"second metadata from decode rank {msg.decode_rank}"),
                             notify=True)
            return
        try:
            dst_layout = self.mgr.peer_layout(msg)
            self.mgr.layout.check_compatible(dst_layout, f"prefill rank {self.mgr.layout.tp_rank} vs decode "
                                                         f"rank {dst_layout.tp_rank}")
        except (ValueError, LayoutMismatchError) as exc:
            self._dsts[key] = Destination(msg, self.mgr.layout, np.zeros(0, np.int64))
            self.fail_locked(KVMetadataError(self.room, str(exc)), notify=True)
            return
        self._dsts[key] = Destination(msg, dst_layout, np.asarray(msg.dst_pages, dtype=np.int64))
        problem = self._check_metadata(msg, dst_layout)
        if problem:
            self.fail_locked(KVMetadataError(self.room, problem), notify=True)
            return
        if self._expected_dsts is not None and self._expected_dsts != msg.expected_dsts:
            self.fail_locked(KVMetadataError(self.room, f"decode ranks disagree on how many send metadata: "
                                                        f"{self._expected_dsts} vs {msg.expected_dsts}"),
                             notify=True)
            return
        self._expected_dsts = msg.expected_dsts
        self._shake_hands(self._dsts[key])
        self._maybe_ready(now)

    def _shake_hands(self, dst: Destination) -> None:
        """Has the peer's worker open its Mooncake session now, while the peer is known to be alive
        (it just sent this metadata): Mooncake 0.3.13 runs a session's first handshake under an
        engine-wide mutex, so a peer that froze before it would stall every peer's writes. The
        handshake is a write of this room's aux slot, which decode reads only after Success (the
        real one lands later on the same worker)."""
        session = dst.layout.session
        if not dst.meta.write_aux or session in self.mgr.sessions_opened:
            return
        self.mgr.sessions_opened[session] = False
        segment = aux_segment(self.mgr.layout, self._aux_index, dst.layout, dst.meta.dst_aux_index)

        def shake() -> None:
            if not self.mgr.begin_write(self.room, self.status, dst.meta.write_by):
                with self.mgr.lock:
                    self.mgr.sessions_opened.pop(session, None)
                return
            try:
                code = self.mgr.writers.write(session, segment.srcs.tolist(), segment.dsts.tolist(),
                                              segment.lens.tolist())
            finally:
                self.mgr.end_write(self.room)
            with self.mgr.lock:
                if code == 0:
                    self.mgr.sessions_opened[session] = True
                else:  # the room's own writes will fail and say why; the next room tries again
                    log.info("handshake write to %s returned %d", session, code)
                    self.mgr.sessions_opened.pop(session, None)

        self.mgr.submit(TransferJob(dst.meta.reply_to, self.room, shake, lambda exc: None))

    def _check_metadata(self, msg: KVMetadata, dst: KVLayout) -> str:
        local = self.mgr.layout
        end = msg.head_start + msg.head_count
        if not (local.head_start <= msg.head_start and end <= local.head_start + local.head_count):
            return f"asked for heads {msg.head_start}..{end} but this rank holds " \
                   f"{local.head_start}..{local.head_start + local.head_count}"
        if not (dst.head_start <= msg.head_start and end <= dst.head_start + dst.head_count):
            return f"heads {msg.head_start}..{end} are not in the decode rank's range"
        if msg.dst_pages and (min(msg.dst_pages) < 0 or max(msg.dst_pages) >= dst.num_pages):
            return f"decode page index outside 0..{dst.num_pages - 1}"
        if not 0 <= msg.dst_aux_index < dst.aux.num_slots:
            return f"decode aux index {msg.dst_aux_index} outside 0..{dst.aux.num_slots - 1}"
        if not 0 <= msg.decode_prefix_len <= len(msg.dst_pages) * dst.page_size:
            return f"decode_prefix_len {msg.decode_prefix_len} outside 0..{len(msg.dst_pages) * dst.page_size}"
        if msg.expected_dsts < 1:
            return f"expected_dsts {msg.expected_dsts} < 1"
        return ""

    def fail_locked(self, error: KVTransferError, notify: bool) -> None:
        """Fails the room (manager lock held) and, if ``notify``, tells every decode rank."""
        if not self.status.fail(error):
            return
        log.info("sender room %d failed: %s", self.room, error)
        if notify:
            for (endpoint, _), dst in self._dsts.items():
                if isinstance(error, KVAbortedError) and error.by == "local":
                    msg: AbortRoom | TransferStatus = AbortRoom(
                        self.room, dst.meta.bootstrap_addr, self.mgr.endpoint, self.mgr.instance_id, str(error))
                else:
                    msg = TransferStatus(self.room, dst.meta.bootstrap_addr, self.mgr.endpoint,
                                         self.mgr.instance_id, self.mgr.layout.tp_rank, int(KVPoll.Failed),
                                         dst.pages_done, str(error))
                self.mgr.send(endpoint, msg)
        self.mgr.tombstone(self.room, str(error))
        self._record(False)

    # --------------------------------------------------------------- internals

    def _maybe_ready(self, now: float) -> None:
        if self.status.state != KVPoll.Bootstrapping or self._num_pages is None:
            return
        if self._expected_dsts is None or len(self._dsts) < self._expected_dsts:
            return
        for dst in self._dsts.values():
            if len(dst.dst_pages) != self._num_pages:
                self.fail_locked(KVLengthMismatchError(self.room, "decode pages for the prompt", self._num_pages,
                                                       len(dst.dst_pages)), notify=True)
                return
        self._ready_at = now
        self.mgr.metrics.room_waited("sender", now - self._created)
        self.status.move(KVPoll.WaitingForInput, now)
        for chunk in self._chunks:
            self._dispatch(chunk, now)

    def _dispatch(self, chunk: Chunk, now: float) -> None:
        if self._first_send_at is None:
            self._first_send_at = now
        if not self.status.move(KVPoll.Transferring, now):
            self.status.touch(now)
        aux_index = self._aux_index
        merges = getattr(self.mgr.engine, "merges_writes", False)  # one copy for many rooms costs ~one copy
        for key, dst in self._dsts.items():
            merge = (lambda d=dst, c=chunk: self._prepare_write(d, c, aux_index)) if merges else None
            self.mgr.submit(TransferJob(key[0], self.room, lambda d=dst, c=chunk: self._write(d, c, aux_index),
                                        lambda exc, d=dst: self._job_failed(d, exc), merge))

    def _write(self, dst: Destination, chunk: Chunk, aux_index: int) -> None:
        """Worker thread: writes one chunk to one decode rank, then reports (off the lock around the write;
        one lock hold before each batch and one after, since every hold may wait for the engine's thread)."""
        if self.status.final:
            return
        segments = self._segments(dst, chunk, aux_index)
        as_lists = not getattr(self.mgr.engine, "takes_arrays", False)  # Mooncake's binding takes lists
        batches = segments.batches(self.mgr.config.transfer_max_batch_segments, as_lists)
        for i, (srcs, dsts, lens) in enumerate(batches):
            with self.mgr.lock:
                self._announce(dst, chunk)
                # Checked and counted under the lock: once the room failed (or its write-by deadline
                # passed) no write starts, and the decode's fence is answered when this one returns.
                if not self.mgr.begin_write(self.room, self.status, dst.meta.write_by):
                    return
            code = None  # stays None if the write raises: the job fails the room then (KVWorkerError)
            try:
                code = self.mgr.writers.write(dst.layout.session, srcs, dsts, lens)
            finally:
                with self.mgr.lock:
                    self.mgr.end_write(self.room)
                    if code == 0 and i == len(batches) - 1:
                        self._chunk_written(dst, chunk, segments.nbytes, time.monotonic())
                    elif code is not None and code != 0:
                        self.fail_locked(KVWriteError(self.room, dst.layout.session, code, int(sum(lens))),
                                         notify=True)
            if code != 0:
                return
        if not batches:
            with self.mgr.lock:
                self._chunk_written(dst, chunk, segments.nbytes, time.monotonic())

    def _announce(self, dst: Destination, chunk: Chunk) -> None:
        """Tells the decode rank the room is Transferring, once, just before the first write (from the worker,
        not from send() on the engine's thread). Not before a last chunk where writes take milliseconds
        (``quick_writes``: CUDA IPC): its Success follows at once and the message would only cost both sides
        a control-thread wake-up per room (the receiver passes through Transferring on Success anyway)."""
        if dst.announced or self.status.final:
            return
        dst.announced = True
        if chunk.last and getattr(self.mgr.engine, "quick_writes", False):
            return
        self.mgr.send(dst.meta.reply_to, self._status_msg(dst, KVPoll.Transferring, ""))

    def _prepare_write(self, dst: Destination, chunk: Chunk, aux_index: int) -> MergeableWrite | None:
        """Worker thread: ``_write``'s steps up to the write itself, for a write merged with other rooms'
        (peer_workers.py); ``None`` when there is nothing to write (done, or the room is over). Its rooms
        finish together (``finish_writes``: one lock hold, one metrics update, one Success message per part)."""
        if self.status.final:
            return None
        pages = self._page_copy(dst, chunk, aux_index)  # planned with the merged write's other rooms
        if pages is not None:
            segments, nbytes = EMPTY, pages.nbytes
            most = len(chunk.pages) * len(self.mgr.layout.buffers) + 1
        else:
            segments = self._segments(dst, chunk, aux_index)
            nbytes, most = segments.nbytes, len(segments)
        if most > self.mgr.config.transfer_max_batch_segments:
            self._write(dst, chunk, aux_index)  # several batches: written on its own
            return None
        with self.mgr.lock:
            if not nbytes:
                self._chunk_written(dst, chunk, 0, time.monotonic())
                return None
            if not dst.announced:
                self._announce(dst, chunk)
            if not self.mgr.begin_write(self.room, self.status, dst.meta.write_by):
                return None
        return MergeableWrite(dst.layout.session, segments.srcs, segments.dsts, segments.lens, None, pages,
                              finish_writes, (self, dst, chunk, nbytes))

    def _page_copy(self, dst: Destination, chunk: Chunk, aux_index: int) -> PageCopy | None:
        """The chunk as whole pages, unplanned, where it is (every head both sides hold, none of its tokens
        already on the decode); ``None`` where it needs ``_segments``' general plan."""
        local, meta, dst_layout = self.mgr.layout, dst.meta, dst.layout
        if not (meta.head_start == local.head_start == dst_layout.head_start
                and meta.head_count == local.head_count == dst_layout.head_count):
            return None
        if meta.decode_prefix_len > chunk.start * local.page_size:
            return None
        dst_pages = dst.dst_pages if chunk.start == 0 and len(chunk.pages) == len(dst.dst_pages) else \
            dst.dst_pages[chunk.start:chunk.start + len(chunk.pages)]
        if chunk.last and meta.write_aux:
            return PageCopy(local, dst_layout, chunk.pages, dst_pages, EMPTY, (aux_index, meta.dst_aux_index))
        return PageCopy(local, dst_layout, chunk.pages, dst_pages)

    def _job_failed(self, dst: Destination, exc: Exception) -> None:
        """Worker thread: a write job raised; this room fails, the worker and other rooms go on."""
        with self.mgr.lock:
            self.fail_locked(KVWorkerError(self.room, dst.meta.reply_to, exc), notify=True)

    def _segments(self, dst: Destination, chunk: Chunk, aux_index: int) -> Segments:
        page_size = self.mgr.layout.page_size
        skip_pages, first_token = divmod(dst.meta.decode_prefix_len, page_size)
        prompt_idx = chunk.start + np.arange(len(chunk.pages))
        keep = prompt_idx >= skip_pages
        parts: list[Segments] = []
        if keep.any():
            first = first_token if prompt_idx[keep][0] == skip_pages else 0
            parts.append(page_segments(self.mgr.layout, dst.layout, chunk.pages[keep], dst.dst_pages[prompt_idx[keep]],
                                       first, dst.meta.head_start, dst.meta.head_count))
        if chunk.last and dst.meta.write_aux:
            parts.append(aux_segment(self.mgr.layout, aux_index, dst.layout, dst.meta.dst_aux_index))
        return concat(parts)

    def _chunk_written(self, dst: Destination, chunk: Chunk, nbytes: int, now: float) -> None:
        if self.status.final:
            return
        dst.chunks_done += 1
        dst.pages_done += len(chunk.pages)
        dst.bytes_done += nbytes
        if chunk.last and dst.chunks_done == len(self._chunks):
            dst.done = True
            final = len(self._dsts) == 1 or all(d.done for d in self._dsts.values())
            if final:
                self.succeeded_at = time.time()  # before the decode can hear of it
            self.mgr.report_success(dst.meta.reply_to, self.room, dst.meta.bootstrap_addr, dst.pages_done)
            if final:
                self.status.move(KVPoll.Success, now)
                self._record(True, now)
            else:
                self.status.touch(now)  # progress: the other decode ranks' writes go on
        else:
            self.status.touch(now)
            self.mgr.send(dst.meta.reply_to, self._status_msg(dst, KVPoll.Transferring, ""))

    def _status_msg(self, dst: Destination, state: KVPoll, reason: str) -> TransferStatus:
        return TransferStatus(self.room, dst.meta.bootstrap_addr, self.mgr.endpoint, self.mgr.instance_id,
                              self.mgr.layout.tp_rank, int(state), dst.pages_done, reason)

    def _record(self, success: bool, now: float | None = None) -> None:
        if self._recorded:
            return
        self._recorded = True
        if now is None:
            now = time.monotonic()
        latency = now - self._first_send_at if self._first_send_at is not None else None
        dsts = self._dsts
        nbytes = next(iter(dsts.values())).bytes_done if len(dsts) == 1 else sum(d.bytes_done for d in dsts.values())
        deferred = self.mgr.deferred_room_metrics
        if deferred is not None:  # a merged part finishing (finish_writes): recorded with the others
            deferred.append((success, nbytes, latency))
        else:
            self.mgr.metrics.room_done("sender", success, nbytes, latency, None)  # its wait: at _maybe_ready


def finish_writes(writes: Sequence[MergeableWrite], code: int | None) -> list[Exception | None]:
    """Worker thread: the merged write of ``writes`` (senders' chunks, ``MergeableWrite.owner`` each
    ``(sender, destination, chunk, bytes)``) returned ``code`` (``None``: it raised; the worker fails the rooms
    then): each room's write ends, its chunk counts as written or the room fails. One hold of the manager's
    lock and one clock read for the part, not one per room. Returns each write's exception (its room is
    failed by the caller) or ``None``."""
    mgr: KVManager = writes[0].owner[0].mgr
    now = time.monotonic()
    out: list[Exception | None] = []
    with mgr.lock:
        recorded: list[tuple[bool, int, float | None]] = []
        mgr.deferred_room_metrics = recorded  # the lock guards it: every room records under it
        try:
            _finish_each(mgr, writes, code, now, out)
        finally:
            mgr.deferred_room_metrics = None
            mgr.metrics.rooms_done("sender", recorded)
    return out


def _finish_each(mgr: KVManager, writes: Sequence[MergeableWrite], code: int | None, now: float,
                 out: list[Exception | None]) -> None:
    for w in writes:
        sender, dst, chunk, nbytes = w.owner
        try:
            mgr.end_write(sender.room)
            if code == 0:
                sender._chunk_written(dst, chunk, nbytes, now)
            elif code is not None:
                sender.fail_locked(KVWriteError(sender.room, dst.layout.session, code, nbytes), notify=True)
            out.append(None)
        except Exception as exc:
            out.append(exc)
