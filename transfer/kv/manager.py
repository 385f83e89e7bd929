"""``KVManager``: one per engine rank; owns Mooncake, the control channel and the threads.

Threads (all daemon, all stopped by ``close``):
- ``transfer-control``: the ZeroMQ control channel; handles every incoming message, sends
  heartbeats, fails rooms whose deadline passed or whose peer went silent;
- ``transfer-worker-<peer>-N`` (``transfer_threads`` per peer, see peer_workers.py): Mooncake
  writes; a peer whose calls block holds only its own workers; one room's jobs to one peer
  always go to the same worker, so its chunks land in order; idle workers end;
- ``transfer-lookup-<addr>``: one per bootstrap address being looked up (layouts are cached
  per address; a lookup is retried every 0.2 s while the server answers 503, and fails its
  rooms once the server has been unreachable for ``LOOKUP_UNREACHABLE_S``); it ends when done.

Every room state change happens under ``self.lock``, which is never held across network
I/O; the scheduler's ``poll()`` takes it only to read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from splitserve.transfer.bootstrap_client import fetch_layouts, publish_layout
from splitserve.transfer.config import TransferConfig
from splitserve.transfer.contract import BaseKVManager
from splitserve.transfer.control_channel import ControlChannel
from splitserve.transfer.control_messages import (
    AbortRoom,
    ControlMessage,
    KVMetadata,
    Ping,
    Pong,
    RoomFenced,
    RoomsDone,
    TransferStatus,
)
from splitserve.transfer.errors import (
    BootstrapError,
    KVAbortedError,
    KVMetadataError,
    KVPeerLostError,
    KVWriteDeadlineError,
    LayoutMismatchError,
    RoomInUseError,
)
from splitserve.transfer.kv.layout import LAYOUT_DIGEST_VERSION, KVLayout, layout_digest
from splitserve.transfer.metrics import TransferMetrics, transfer_metrics
from splitserve.transfer.mooncake.engine import MooncakeEngine
from splitserve.transfer.mooncake.peer_engines import PeerEngines
from splitserve.transfer.peer_liveness import PeerLiveness
from splitserve.transfer.peer_workers import PeerWorkers, TransferJob
from splitserve.transfer.poll_state import KVPoll
from splitserve.transfer.room_status import RoomStatus
from splitserve.transfer.write_fence import WriteFence, nothing_listens

if TYPE_CHECKING:
    from splitserve.transfer.kv.receiver import KVReceiver
    from splitserve.transfer.kv.sender import KVSender

    Room = KVSender | KVReceiver

log = logging.getLogger(__name__)

LOOKUP_RETRY_S = 0.2
# A bootstrap server refusing connections (or answering garbage) this long is not coming up:
# its rooms fail now, not at their bootstrap deadline. One still starting answers 503 (retried).
LOOKUP_UNREACHABLE_S = 1.0
WORKER_IDLE_S = 5.0
PEER_LAYOUTS_KEPT = 1024  # decode layouts kept by digest (one per decode rank; the least recently used goes)
# A fenced room whose prefill ranks stay silent past a heartbeat timeout is checked this often:
# is anything still listening at their control endpoints, and does their bootstrap server list them?
FENCE_CHECK_S = 1.0
FENCE_QUERY = "fence: the room failed on decode; answer once no write for it is in flight"


class KVManager(BaseKVManager):
    """The transfer side of one engine rank (prefill or decode).

    ``layout`` describes this rank's KV and aux buffers (``layout_for_pool`` builds it);
    the manager registers them with Mooncake once and fills in the session, control
    endpoint and instance id (see ``self.layout``). A prefill rank then calls
    ``publish_layout(bootstrap_addr)`` once at start-up.

    The layout holds only addresses: the caller must keep the KV pool and the aux tensor
    alive until ``close()`` returns (peers write into them; a freed aux tensor corrupts the
    heap).
    """

    def __init__(self, config: TransferConfig, layout: KVLayout, *,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.instance_id = secrets.token_hex(8)
        self.metrics: TransferMetrics = transfer_metrics(metrics_registry)
        self.lock = threading.RLock()
        self._closed = False
        self.engine = self._open_transport(config)
        try:
            for buf in layout.buffers:
                self.engine.register(buf.ptr, buf.nbytes)
            self.engine.register(layout.aux.ptr, layout.aux.nbytes)
        except Exception:
            self.engine.close()
            raise
        regions = [(buf.ptr, buf.nbytes) for buf in layout.buffers] + [(layout.aux.ptr, layout.aux.nbytes)]
        self.writers = PeerEngines(self.engine, regions, config.transfer_writer_engines)
        self.sender_timeouts = {
            KVPoll.Bootstrapping: config.transfer_bootstrap_timeout_s,
            KVPoll.WaitingForInput: config.transfer_waiting_timeout_s,
            KVPoll.Transferring: config.transfer_timeout_s,
        }
        self.receiver_timeouts = dict(self.sender_timeouts)
        self._liveness = PeerLiveness(config.transfer_heartbeat_interval_s, config.transfer_heartbeat_misses)
        self._ping_seq = 0
        self._senders: dict[int, KVSender] = {}
        self._receivers: dict[tuple[str, int], KVReceiver] = {}
        self._early_metadata: dict[int, list[tuple[float, KVMetadata]]] = {}
        self._tombstones: dict[int, tuple[float, str]] = {}
        self._peer_rooms: dict[str, set[Room]] = {}
        self._peer_idle_since: dict[str, float] = {}
        self._layouts: dict[str, list[KVLayout]] = {}
        self._lookups: dict[str, threading.Thread] = {}  # bootstrap address -> its lookup thread
        self._pending_aborts: dict[str, list[tuple[float, int, str]]] = {}
        self._lookup_cv = threading.Condition(self.lock)
        self._rooms_changed = threading.Condition(self.lock)  # a room's state changed (see wait_locked)
        self._state_listeners: list[Callable[[int, KVPoll], None]] = []
        self._layout_dict: tuple[KVLayout, dict, str] | None = None
        # Prefill side: decode layouts by digest (their raw form, parsed). Decode side: the prefill
        # (endpoint, instance) pairs our layout went to in a room's metadata (later rooms send its digest).
        self._peer_layouts: OrderedDict[str, tuple[dict, KVLayout]] = OrderedDict()
        self._layout_sent: set[tuple[str, str]] = set()
        # Merged writes go through the writers too (looked up at call time: benchmarks wrap them).
        self.workers = PeerWorkers(config.transfer_threads, WORKER_IDLE_S,
                                   write=lambda *args: self.writers.write(*args),
                                   launch_pages=(lambda *args: self.writers.launch_pages(*args))
                                   if hasattr(self.engine, "launch_pages") else None,
                                   finish_together=self.finishing_together)
        self._done_batch = threading.local()  # see finishing_together
        # Sender rooms finished while a merged part finishes (kv_sender.finish_writes, lock held): their metrics,
        # recorded together after it. None otherwise.
        self.deferred_room_metrics: list[tuple[bool, int, float | None]] | None = None
        # Mooncake sessions whose handshake was queued (False) or done (True): see KVSender._shake_hands.
        self.sessions_opened: dict[str, bool] = {}
        # Prefill side: writes in flight per room, and the fence answers owed once they end.
        self._writing: dict[int, int] = {}
        self._fence_owed: dict[int, dict[str, str]] = {}  # room -> {decode endpoint: bootstrap addr}
        # Decode side: failed rooms whose pages are held until no write for them can land.
        self._fences: dict[tuple[str, int], WriteFence] = {}
        self._fence_checks: dict[str, threading.Thread] = {}  # bootstrap address -> its check thread
        key = config.transfer_control_key.encode()
        tick_s = min(0.05, config.transfer_heartbeat_interval_s / 4)
        try:
            self.channel = ControlChannel(config.transfer_host, config.transfer_control_port, key,
                                          self._on_message, self._on_tick, tick_s,
                                          idle_socket_s=2 * config.heartbeat_timeout_s)
        except Exception:
            self.engine.close()
            raise
        self.layout = dataclasses.replace(layout, session=self.engine.session_id,
                                          control_endpoint=self.channel.endpoint,
                                          instance_id=self.instance_id)
        log.info("transfer manager %s: session %s, control %s, %d buffers", self.instance_id,
                 self.engine.session_id, self.channel.endpoint, len(layout.buffers))

    def _open_transport(self, config: TransferConfig) -> MooncakeEngine:
        """The data path (another backend's manager returns its own engine of the same surface)."""
        return MooncakeEngine(config.transfer_host, config.transfer_protocol, config.transfer_devices)

    # ----------------------------------------------------------------- public

    @property
    def endpoint(self) -> str:
        """This manager's ZeroMQ control endpoint."""
        return self.channel.endpoint

    def publish_layout(self, bootstrap_addr: str, timeout_s: float | None = None) -> None:
        """Registers this rank's layout at the bootstrap server (blocking; call at start-up)."""
        publish_layout(bootstrap_addr, self.layout, self.config.transfer_control_key,
                       self.config.transfer_bootstrap_timeout_s if timeout_s is None else timeout_s)

    def abort_room(self, room: int, reason: str, bootstrap_addr: str | None = None) -> None:
        """Fails a room that may have no sender/receiver here (yet), and tells the other side.

        Prefill side (``bootstrap_addr`` None): for a request refused before its sender
        exists; decode ranks whose metadata is waiting, or arrives later, get an abort.
        Decode side (the prefill's ``bootstrap_addr``): for a request dropped before its
        receiver exists; every prefill rank of that replica is told, so its sender fails at
        once instead of waiting out the bootstrap timeout with the prompt's pages held.
        An existing sender/receiver for the room is simply aborted. Never blocks.
        """
        now = time.monotonic()
        with self.lock:
            if bootstrap_addr is None:
                sender = self._senders.get(room)
                if sender is not None:
                    sender.fail_locked(KVAbortedError(room, "local", reason), notify=True)
                    return
                self._tombstones[room] = (now + self.config.transfer_bootstrap_timeout_s, reason)
                for _, msg in self._early_metadata.pop(room, []):
                    self.channel.send(msg.reply_to, AbortRoom(room, msg.bootstrap_addr, self.endpoint,
                                                              self.instance_id, reason))
                return
            receiver = self._receivers.get((bootstrap_addr, room))
            if receiver is not None:
                receiver.fail_locked(KVAbortedError(room, "local", reason), notify=True)
                return
            layouts = self._layouts.get(bootstrap_addr)
            if layouts is not None:
                self._send_aborts(bootstrap_addr, layouts, [(now, room, reason)])
                return
            self._pending_aborts.setdefault(bootstrap_addr, []).append((now, room, reason))
            self._start_lookup_locked(bootstrap_addr)

    def _send_aborts(self, bootstrap_addr: str, layouts: list[KVLayout],
                     aborts: list[tuple[float, int, str]]) -> None:
        for _, room, reason in aborts:
            for lay in layouts:
                self.channel.send(lay.control_endpoint, AbortRoom(room, bootstrap_addr, self.endpoint,
                                                                  self.instance_id, reason))

    @property
    def copy_stream(self) -> Any:
        """The device stream this rank's writes run on where it has one of its own (CUDA IPC), else None: a
        writer of the aux slots the writes read queues them there (``AuxWriter``), so they land first."""
        return None

    def stats(self) -> dict[str, int]:
        """Counts that must return to zero when no room is open (tests use them)."""
        with self.lock:
            return {
                "rooms": len(self._senders) + len(self._receivers),
                "senders": len(self._senders),
                "receivers": len(self._receivers),
                "early_metadata": len(self._early_metadata),
                "pending_aborts": sum(len(a) for a in self._pending_aborts.values()),
                "watched_peers": len(self._liveness),
                "peer_rooms": sum(len(r) for r in self._peer_rooms.values()),
                "peer_sockets": self.channel.peer_sockets,
                "dropped_messages": self.channel.dropped,
                "worker_threads": self.workers.threads,
                "lookup_threads": len(self._lookups),
                "fence_check_threads": len(self._fence_checks),
                "writer_engines": self.writers.engines,
                "fences": len(self._fences),
                "writes_in_flight": sum(self._writing.values()),
            }

    def close(self) -> None:
        """Fails open rooms, stops every thread, unregisters memory. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for room in [*self._senders.values(), *self._receivers.values()]:
                room.fail_locked(KVPeerLostError(room.room, "local", "transfer manager closed"), notify=True)
            self._lookup_cv.notify_all()
            lookups = [*self._lookups.values(), *self._fence_checks.values()]
        self.workers.close()
        for thread in lookups:
            thread.join(timeout=6)  # a lookup may be in its HTTP call (5 s at most)
            if thread.is_alive():
                log.warning("%s still running at close", thread.name)
        self.channel.close()
        self.writers.close()
        self.engine.close()
        with self.lock:
            self._senders.clear()
            self._receivers.clear()
            self._peer_rooms.clear()

    def layout_dict(self) -> tuple[dict, str]:
        """``self.layout.to_dict()`` and its ``layout_digest``, made once (every room's metadata names it)."""
        cached = self._layout_dict
        if cached is None or cached[0] is not self.layout:
            raw = self.layout.to_dict()
            cached = self._layout_dict = (self.layout, raw, layout_digest(raw))
        return cached[1], cached[2]

    def layout_due(self, endpoint: str, instance: str) -> bool:
        """Decode side (lock held): whether a room's metadata to the prefill rank at ``endpoint`` (that
        instance of it) carries our layout; after this the ones to it carry only the digest. Control
        messages to one endpoint arrive in order, so a room's metadata sent after the one carrying the
        layout finds it there."""
        key = (endpoint, instance)
        if key in self._layout_sent:
            return False
        self._layout_sent.add(key)
        return True

    def layout_lost(self, endpoint: str) -> None:
        """Decode side (lock held): a room at ``endpoint`` failed there, gone, or restarted: perhaps it does
        not hold our layout (message lost, its cache full, a new instance), so the next room sends it."""
        self._layout_sent = {key for key in self._layout_sent if key[0] != endpoint}

    def peer_layout(self, msg: KVMetadata) -> KVLayout:
        """Prefill side: the layout of the decode rank that sent ``msg``, by its digest: parsed, checked
        against the digest and kept when the message carries it, else the one it carried before. Raises
        ``ValueError`` with the reason (malformed, digest of another version or not matching, unknown)."""
        digest, raw = msg.dst_layout_digest, msg.dst_layout
        if not digest.startswith(LAYOUT_DIGEST_VERSION + ":"):
            raise ValueError(f"decode layout digest {digest[:80]!r} is not of version {LAYOUT_DIGEST_VERSION} "
                             "(a peer of another splitserve version?)")
        with self.lock:
            hit = self._peer_layouts.get(digest)
            if hit is not None and (not raw or hit[0] == raw):
                self._peer_layouts.move_to_end(digest)
                return hit[1]
        if not raw:
            raise ValueError(f"decode layout {digest} is not known here (the metadata that carried it was lost, "
                             "or this prefill restarted or forgot it); the decode sends it with its next room")
        if layout_digest(raw) != digest:
            raise ValueError(f"decode layout does not match its digest {digest} (corrupt metadata)")
        layout = KVLayout.from_dict(raw)
        with self.lock:
            self._peer_layouts[digest] = (raw, layout)
            if len(self._peer_layouts) > PEER_LAYOUTS_KEPT:
                self._peer_layouts.popitem(last=False)
        return layout

    def add_state_listener(self, listener: Callable[[int, KVPoll], None]) -> None:
        """Calls ``listener(room, state)`` whenever a room of this manager changes state (Success, Failed,
        ...), so an engine waiting idle for its transfers wakes at once instead of at its next poll. It runs
        under the manager's lock on whichever thread made the change: it must only signal (set an event)."""
        with self.lock:
            self._state_listeners.append(listener)

    # ------------------------------------------------ rooms (called by rooms)

    def room_changed_locked(self, status: RoomStatus) -> None:
        """A room's state changed (lock held): wakes ``wait_locked`` callers and the listeners."""
        self._rooms_changed.notify_all()
        for listener in self._state_listeners:
            try:
                listener(status.room, status.state)
            except Exception:
                log.exception("transfer state listener failed")

    def wait_locked(self, timeout_s: float) -> None:
        """Sleeps (lock held, released meanwhile) until some room changes state or ``timeout_s`` passes."""
        self._rooms_changed.wait(timeout_s)

    def add_sender(self, sender: KVSender) -> None:
        with self.lock:
            if self._closed:
                raise RuntimeError("transfer manager is closed")
            if sender.room in self._senders:
                raise RoomInUseError(sender.room, sender.bootstrap_addr)
            self._senders[sender.room] = sender
            now = time.monotonic()
            tomb = self._tombstones.pop(sender.room, None)
            for _, msg in self._early_metadata.pop(sender.room, []):
                sender.on_metadata_locked(msg, now)
            if tomb is not None:
                sender.fail_locked(KVAbortedError(sender.room, "peer", tomb[1]), notify=True)

    def add_receiver(self, receiver: KVReceiver) -> None:
        with self.lock:
            if self._closed:
                raise RuntimeError("transfer manager is closed")
            key = (receiver.bootstrap_addr, receiver.room)
            if key in self._receivers:
                raise RoomInUseError(receiver.room, receiver.bootstrap_addr)
            self._receivers[key] = receiver

    def remove_room(self, room: Room) -> None:
        """Forgets ``room`` and its peer links (its state stays readable on the object)."""
        with self.lock:
            if self._senders.get(room.room) is room:
                del self._senders[room.room]
            key = (room.bootstrap_addr, room.room)
            if self._receivers.get(key) is room:
                del self._receivers[key]
            now = time.monotonic()
            for endpoint, rooms in self._peer_rooms.items():
                if room in rooms:
                    rooms.discard(room)
                    if not rooms:
                        self._peer_idle_since[endpoint] = now

    def attach_peer(self, room: Room, endpoint: str, instance: str) -> None:
        """Watches ``endpoint`` with heartbeats while ``room`` is open."""
        with self.lock:
            self._peer_rooms.setdefault(endpoint, set()).add(room)
            self._peer_idle_since.pop(endpoint, None)
            self._liveness.watch(endpoint, instance, time.monotonic())

    def tombstone(self, room: int, reason: str) -> None:
        """Remembers a dead sender room so late metadata from decode is answered with an abort."""
        with self.lock:
            self._tombstones[room] = (time.monotonic() + self.config.transfer_bootstrap_timeout_s, reason)

    def send(self, endpoint: str, msg: ControlMessage, direct: bool = True) -> None:
        self.channel.send(endpoint, msg, direct)

    @contextlib.contextmanager
    def finishing_together(self, last: bool = False) -> Iterator[None]:
        """Rooms whose last write finishes inside this (on this thread: one merged write's rooms) tell each
        decode rank their Success in one ``RoomsDone``, not a message each: one encode, one send and one
        decode for them all, instead of one per room on both sides. It goes through the control thread
        (ZeroMQ's send releases the GIL per frame, which the engine thread, sending more rooms meanwhile,
        takes), unless ``last``: nothing else is queued behind these rooms, so a hop less for their Success."""
        batch: list[tuple[str, str, int, int]] = []  # (endpoint, bootstrap address, room, pages done)
        self._done_batch.rooms = batch
        try:
            yield
        finally:
            self._done_batch.rooms = None
            groups: dict[tuple[str, str], list[tuple[str, str, int, int]]] = {}
            for done in batch:
                groups.setdefault(done[:2], []).append(done)
            for (endpoint, addr), rooms in groups.items():
                if len(rooms) == 1:
                    self.send(endpoint, self._success(addr, rooms[0][2], rooms[0][3]))
                else:
                    self.send(endpoint, RoomsDone([r[2] for r in rooms], [r[3] for r in rooms], addr, self.endpoint,
                                                  self.instance_id, self.layout.tp_rank), direct=last)

    def _success(self, bootstrap_addr: str, room: int, pages_done: int) -> TransferStatus:
        return TransferStatus(room, bootstrap_addr, self.endpoint, self.instance_id, self.layout.tp_rank,
                              int(KVPoll.Success), pages_done, "")

    def report_success(self, endpoint: str, room: int, bootstrap_addr: str, pages_done: int) -> None:
        """Sends a room's Success to a decode rank: now, or with the others of ``finishing_together``."""
        batch = getattr(self._done_batch, "rooms", None)
        if batch is None:
            self.send(endpoint, self._success(bootstrap_addr, room, pages_done))
        else:
            batch.append((endpoint, bootstrap_addr, room, pages_done))

    def submit(self, job: TransferJob) -> None:
        """Queues a write job on its peer's workers; one room's jobs to one peer share a worker (in order)."""
        self.workers.submit(job)

    def wait_writes_issued(self, timeout_s: float) -> bool:
        """Waits until every write job submitted so far is issued (a device copy queued); False on timeout."""
        return self.workers.wait_issued(timeout_s)

    # ------------------------------------------------ write accounting (prefill)

    def begin_write(self, room: int, status: RoomStatus, write_by: float) -> bool:
        """A worker asks to start one Mooncake write for ``room``: refused once the room is final
        or past the decode's write-by deadline (the room fails then); counted until ``end_write``."""
        with self.lock:
            if status.final:
                return False
            late = time.time() - write_by
            if late >= 0:
                sender = self._senders.get(room)
                if sender is not None and sender.status is status:
                    sender.fail_locked(KVWriteDeadlineError(room, late), notify=True)
                return False
            self._writing[room] = self._writing.get(room, 0) + 1
            return True

    def end_write(self, room: int) -> None:
        """The write ``begin_write`` allowed returned; fence answers owed for the room go out."""
        with self.lock:
            left = self._writing[room] - 1
            if left:
                self._writing[room] = left
                return
            del self._writing[room]
            if self._fence_owed:
                for endpoint, addr in self._fence_owed.pop(room, {}).items():
                    self.channel.send(endpoint, RoomFenced(room, addr, self.endpoint, self.instance_id))

    def _answer_fence(self, room: int, endpoint: str, bootstrap_addr: str) -> None:
        """A decode rank asks whether a write of ours for ``room`` may still land (the room is dead
        here by now): answered at once, or when the writes in flight return."""
        if room in self._writing:
            self._fence_owed.setdefault(room, {})[endpoint] = bootstrap_addr
        else:
            self.channel.send(endpoint, RoomFenced(room, bootstrap_addr, self.endpoint, self.instance_id))

    # ------------------------------------------------------ fences (decode)

    def fence_locked(self, room: int, bootstrap_addr: str, prefill: list[KVLayout], write_by: float) -> WriteFence:
        """Holds a failed room's pages until no write of the ``prefill`` ranks can land
        (``write_by`` is the room's deadline on this clock); asks every rank at once."""
        now = time.monotonic()
        fence = WriteFence(room, bootstrap_addr, {lay.control_endpoint: lay.instance_id for lay in prefill},
                           now, write_by + self.config.transfer_fence_grace_s, now)
        if self._fences.get((bootstrap_addr, room)) is None:
            self.metrics.fenced_rooms.inc()
        self._fences[(bootstrap_addr, room)] = fence
        self._query_fence(fence, now)
        return fence

    def fence_lifted(self, fence: WriteFence) -> bool:
        """Whether ``fence`` is over (its pages may be reused)."""
        with self.lock:
            lifted = fence.lifted(time.monotonic())
            if lifted:
                self._drop_fence(fence)
            return lifted

    def _drop_fence(self, fence: WriteFence) -> None:
        key = (fence.bootstrap_addr, fence.room)
        if self._fences.get(key) is fence:
            del self._fences[key]
            self.metrics.fenced_rooms.dec()
            self.metrics.fences_total.labels(outcome=fence.outcome).inc()
            log.log(logging.WARNING if fence.outcome == "deadline" else logging.DEBUG,
                    "fence of room %d (%s) lifted after %.1fs: %s", fence.room, fence.bootstrap_addr,
                    time.monotonic() - fence.created, fence.outcome)

    def _query_fence(self, fence: WriteFence, now: float) -> None:
        for endpoint in fence.pending:
            self.channel.send(endpoint, AbortRoom(fence.room, fence.bootstrap_addr, self.endpoint,
                                                  self.instance_id, FENCE_QUERY))
        fence.next_query = now + self.config.transfer_heartbeat_interval_s

    def _tend_fences(self, now: float) -> None:
        for fence in list(self._fences.values()):
            if fence.lifted(now):
                self._drop_fence(fence)
                continue
            if now >= fence.next_query:
                self._query_fence(fence, now)
            if now - fence.created > self._liveness.timeout_s and now >= fence.next_lookup:
                fence.next_lookup = now + FENCE_CHECK_S
                self._start_fence_check_locked(fence.bootstrap_addr)

    def _start_fence_check_locked(self, addr: str) -> None:
        if addr in self._fence_checks or self._closed:
            return
        peers = {(e, i) for f in self._fences.values() if f.bootstrap_addr == addr for e, i in f.pending.items()}
        thread = threading.Thread(target=self._check_fence_peers, args=(addr, peers), daemon=True,
                                  name=f"transfer-fence-check-{addr}")
        self._fence_checks[addr] = thread
        thread.start()

    def _check_fence_peers(self, addr: str, peers: set[tuple[str, str]]) -> None:
        """Thread: which silent prefill ranks of fenced rooms are known gone (see write_fence.py)."""
        gone = {(endpoint, instance) for endpoint, instance in peers if nothing_listens(endpoint)}
        try:
            layouts: list[KVLayout] | None = fetch_layouts(addr, self.config.transfer_control_key, timeout_s=2.0)
        except BootstrapError:
            layouts = None  # unreachable, or ranks still registering: tells nothing
        with self.lock:
            self._fence_checks.pop(addr, None)
            for fence in self._fences.values():
                if fence.bootstrap_addr != addr:
                    continue
                for endpoint, instance in gone:
                    fence.peer_gone(endpoint, instance)
                if layouts is not None:
                    fence.registered({(lay.control_endpoint, lay.instance_id) for lay in layouts})

    def request_layouts(self, receiver: KVReceiver) -> None:
        """Hands ``receiver`` the prefill's layouts now (cached) or when the lookup succeeds."""
        with self.lock:
            layouts = self._layouts.get(receiver.bootstrap_addr)
            if layouts is not None:
                receiver.on_layouts_locked(layouts, time.monotonic())
                return
            self._start_lookup_locked(receiver.bootstrap_addr)

    def _start_lookup_locked(self, addr: str) -> None:
        """One lookup thread per bootstrap address: an address that hangs delays only its own rooms."""
        if addr in self._lookups or self._closed:
            return
        thread = threading.Thread(target=self._lookup, args=(addr,), name=f"transfer-lookup-{addr}", daemon=True)
        self._lookups[addr] = thread
        thread.start()

    # ---------------------------------------------------------- control thread

    def _on_message(self, msg: ControlMessage) -> None:
        now = time.monotonic()
        with self.lock:
            old_instance = self._liveness.heard(msg.reply_to, msg.instance, now)
            if old_instance is not None:
                self._peer_restarted(msg.reply_to, old_instance, msg.instance)
            for fence in list(self._fences.values()):
                fence.peer_seen(msg.reply_to, msg.instance)
            if isinstance(msg, Ping):
                self.channel.send(msg.reply_to, Pong(self.endpoint, self.instance_id, msg.seq))
            elif isinstance(msg, Pong):
                pass
            elif isinstance(msg, KVMetadata):
                self._on_metadata(msg, now)
            elif isinstance(msg, TransferStatus):
                self._on_status(msg, now)
            elif isinstance(msg, RoomsDone):
                if len(msg.rooms) != len(msg.pages_done):
                    log.warning("dropped rooms_done from %s: %d rooms, %d page counts", msg.reply_to,
                                len(msg.rooms), len(msg.pages_done))
                    return
                self._on_rooms_done(msg, now)
            elif isinstance(msg, AbortRoom):
                self._on_abort(msg)
            elif isinstance(msg, RoomFenced):
                fence = self._fences.get((msg.bootstrap_addr, msg.room))
                if fence is not None:
                    fence.acknowledged(msg.reply_to)

    def _on_rooms_done(self, msg: RoomsDone, now: float) -> None:
        """Each room's Success, as its ``TransferStatus`` would say, without making one per room."""
        receivers, addr = self._receivers, msg.bootstrap_addr
        for room in msg.rooms:
            receiver = receivers.get((addr, room))
            if receiver is None:
                log.debug("rooms_done for unknown room %d from %s", room, msg.reply_to)
            else:
                receiver.on_success_locked(msg.prefill_rank, now)

    def _on_status(self, msg: TransferStatus, now: float) -> None:
        receiver = self._receivers.get((msg.bootstrap_addr, msg.room))
        if receiver is None:
            log.debug("status for unknown room %d from %s", msg.room, msg.reply_to)
        else:
            receiver.on_status_locked(msg, now)

    def _on_metadata(self, msg: KVMetadata, now: float) -> None:
        if msg.dst_layout:
            # Kept now, in arrival order, not when the room's sender takes it: a later room naming only the
            # digest may get its sender first. A bad layout fails its room there, with the reason.
            with contextlib.suppress(ValueError, LayoutMismatchError):
                self.peer_layout(msg)
        tomb = self._tombstones.get(msg.room)
        sender = self._senders.get(msg.room)
        if sender is not None:
            sender.on_metadata_locked(msg, now)
        elif tomb is not None:
            self.channel.send(msg.reply_to, AbortRoom(msg.room, msg.bootstrap_addr, self.endpoint,
                                                      self.instance_id, tomb[1]))
        else:
            self._early_metadata.setdefault(msg.room, []).append((now, msg))

    def _on_abort(self, msg: AbortRoom) -> None:
        error = KVAbortedError(msg.room, f"peer {msg.reply_to}", msg.reason)
        sender = self._senders.get(msg.room)
        receiver = self._receivers.get((msg.bootstrap_addr, msg.room))
        if receiver is not None and (sender is None or not sender.has_peer(msg.reply_to)):
            receiver.fail_locked(error, notify=False)
            return
        if (msg.bootstrap_addr, msg.room) in self._fences:
            return  # our own fenced room: the prefill's abort tells nothing new
        if sender is not None:
            sender.fail_locked(error, notify=True)
        else:
            # Abort before the sender exists (decode gave up first), or after it was cleared: remember
            # it (a repeated one, the decode's fence query, keeps the first reason and extends it).
            self._early_metadata.pop(msg.room, None)
            reason = self._tombstones.get(msg.room, (0.0, f"aborted by peer {msg.reply_to}: {msg.reason}"))[1]
            self._tombstones[msg.room] = (time.monotonic() + self.config.transfer_bootstrap_timeout_s, reason)
        self._answer_fence(msg.room, msg.reply_to, msg.bootstrap_addr)

    def _peer_restarted(self, endpoint: str, old: str, new: str) -> None:
        log.warning("transfer peer %s restarted (instance %s -> %s)", endpoint, old, new)
        for room in list(self._peer_rooms.get(endpoint, ())):
            if room.peer_instance(endpoint) != new:
                room.fail_locked(KVPeerLostError(room.room, endpoint, f"peer restarted (instance {old})"),
                                 notify=True)
        self._forget_layouts_of(endpoint)
        self.layout_lost(endpoint)

    def _forget_layouts_of(self, endpoint: str) -> None:
        """Drops the cached layouts of the replica ``endpoint`` belongs to: the next room looks them up."""
        for addr, layouts in list(self._layouts.items()):
            if any(lay.control_endpoint == endpoint for lay in layouts):
                del self._layouts[addr]

    def _on_tick(self, now: float) -> None:
        with self.lock:
            for endpoint in self._liveness.pings_due(now):
                self._ping_seq += 1
                self.channel.send(endpoint, Ping(self.endpoint, self.instance_id, self._ping_seq))
            for endpoint in self._liveness.expire(now):
                self._peer_dead(endpoint)
            for room in [*self._senders.values(), *self._receivers.values()]:
                error = room.status.expired(now)
                if error is not None:
                    room.fail_locked(error, notify=True)
            self._tend_fences(now)
            horizon = now - self.config.transfer_bootstrap_timeout_s
            for room_id, entries in list(self._early_metadata.items()):
                if entries[-1][0] < horizon:
                    del self._early_metadata[room_id]
            for addr, aborts in list(self._pending_aborts.items()):
                kept = [a for a in aborts if a[0] >= horizon]
                if kept:
                    self._pending_aborts[addr] = kept
                else:
                    del self._pending_aborts[addr]
            for room_id, (expiry, _) in list(self._tombstones.items()):
                if expiry < now:
                    del self._tombstones[room_id]
            for endpoint, since in list(self._peer_idle_since.items()):
                if now - since > self._liveness.timeout_s:
                    del self._peer_idle_since[endpoint]
                    if not self._peer_rooms.get(endpoint):
                        self._peer_rooms.pop(endpoint, None)
                        self._liveness.unwatch(endpoint)
                        # Unwatched, a restart of that peer would go unseen: its cached layout
                        # (control endpoint, instance) is trusted only while heartbeats vouch for it.
                        self._forget_layouts_of(endpoint)

    def _peer_dead(self, endpoint: str) -> None:
        timeout = self._liveness.timeout_s
        rooms = self._peer_rooms.pop(endpoint, set())
        log.warning("transfer peer %s silent for %.1fs: failing %d rooms", endpoint, timeout, len(rooms))
        for room in rooms:
            room.fail_locked(KVPeerLostError(room.room, endpoint, f"no heartbeat for {timeout:g}s"),
                             notify=True)
        self._peer_idle_since.pop(endpoint, None)
        self.channel.forget(endpoint)
        self._forget_layouts_of(endpoint)
        self.layout_lost(endpoint)

    # ------------------------------------------------------------- lookups

    def _lookup(self, addr: str) -> None:
        """Looks ``addr``'s layouts up until found or nobody waits for them any more."""
        unreachable_since: float | None = None
        while True:
            try:
                layouts = fetch_layouts(addr, self.config.transfer_control_key,
                                        timeout_s=min(5.0, self.config.transfer_bootstrap_timeout_s))
                problem, unreachable_since = "not every prefill rank registered (503)", None
            except BootstrapError as exc:
                layouts, problem = None, str(exc)
                unreachable_since = unreachable_since or time.monotonic()
            with self.lock:
                if self._closed:
                    self._lookups.pop(addr, None)
                    return
                waiting = [r for (a, _), r in self._receivers.items() if a == addr and r.waiting_for_layouts]
                if layouts is not None:
                    self._layouts[addr] = layouts
                    now = time.monotonic()
                    for receiver in waiting:
                        receiver.on_layouts_locked(layouts, now)
                    self._send_aborts(addr, layouts, self._pending_aborts.pop(addr, []))
                    self._lookups.pop(addr, None)
                    return
                if unreachable_since is not None and time.monotonic() - unreachable_since >= LOOKUP_UNREACHABLE_S:
                    for receiver in waiting:
                        receiver.fail_locked(KVMetadataError(receiver.room, f"cannot look the prefill's layout "
                                                                            f"up: {problem}"), notify=False)
                    self._pending_aborts.pop(addr, None)  # nobody there to tell
                    waiting = []
                if not waiting and not self._pending_aborts.get(addr):
                    self._lookups.pop(addr, None)
                    return
                log.debug("layout lookup at %s: %s", addr, problem)
                self._lookup_cv.wait(LOOKUP_RETRY_S)
                if self._closed:
                    self._lookups.pop(addr, None)
                    return

