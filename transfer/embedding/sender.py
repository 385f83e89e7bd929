"""The encoder's side: ship each image item's rows to the prefill rank waiting for its room.

`begin(room)` opens the room (False if it is taken), `begin_all(rooms, owner)` one call's rooms, all
or none, marked as the call's; `close_rooms(owner, rooms, reason)` closes those of them still open
and not being written, once the call failed before its answer reached the router (no prefill will
ask for them); `send(chunk)` hands over where the rows are (a slot of this encoder's registered
pool), their rows, hidden size, dtype and bytes; the rows go out once the prefill rank's
`EmbeddingWanted` for the room is in hand (it may come before or after). Before any write, the
chunk is checked against what the prefill rank expects (rows, hidden, dtype, bytes); a mismatch
fails the item on both sides and writes nothing. `fail(room, reason)` fails an item (e.g. the
image did not decode); `concluded()` returns the rooms finished since the last call, so the caller
can unpin their source slots.

Fences (write_fence.py): every Mooncake write is counted per room while in flight, and none
starts once the prefill aborted the room or past the ask's `write_by`; an `EmbeddingAbort` is
answered `EmbeddingFenced` once no counted write for the room is in flight (at once, or when the
write returns), so the prefill knows when the item's slot may be reused.

`pause_halfway_s` (tests only) writes each item in two halves with a pause between, so that a
test can kill the encoder while an item is partly written (`stats()["partly_written"]` says when).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from splitserve.transfer.config import TransferConfig
from splitserve.transfer.control_messages import ControlMessage
from splitserve.transfer.embedding.endpoint import EmbeddingEndpoint
from splitserve.transfer.embedding.messages import EmbeddingAbort, EmbeddingFenced, EmbeddingStatus, EmbeddingWanted
from splitserve.transfer.embedding.slots import EmbeddingSlots

log = logging.getLogger(__name__)

FAILED, LANDED = 0, 2


@dataclass(frozen=True)
class EmbeddingChunk:
    """One item's rows: slot `slot` of the sender's pool, `rows` x `hidden` of `dtype` (`nbytes`)."""

    room: int
    slot: int
    rows: int
    hidden: int
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class Concluded:
    room: int
    ok: bool
    reason: str
    slot: int | None  # the source slot the chunk used (None: no chunk was sent)


@dataclass
class SendRoom:
    room: int
    created: float
    owner: int | None = None  # the call that opened it (closing a call closes only its own rooms)
    chunk: EmbeddingChunk | None = None
    wanted: EmbeddingWanted | None = None
    ready_at: float | None = None
    writing: bool = False
    written: int = 0  # bytes of the chunk already written to the prefill's slot
    done: bool = False


def expected_problem(chunk: EmbeddingChunk, want: EmbeddingWanted, itemsize: int) -> str:
    """Why `chunk` must not be written where `want` says, or "" (pure)."""
    for what, ours, theirs in (("rows", chunk.rows, want.rows), ("hidden size", chunk.hidden, want.hidden),
                               ("dtype", chunk.dtype, want.dtype), ("bytes", chunk.nbytes, want.nbytes)):
        if ours != theirs:
            return f"embedding {what} mismatch: the encoder has {ours}, the prefill expects {theirs}"
    if chunk.nbytes != chunk.rows * chunk.hidden * itemsize:
        return f"embedding bytes {chunk.nbytes} != rows {chunk.rows} x hidden {chunk.hidden} x {itemsize}"
    return ""


class EmbeddingSender(EmbeddingEndpoint):
    """The encode engine's embedding transfer (one per encode rank)."""

    def __init__(self, config: TransferConfig, slots: EmbeddingSlots,
                 metrics_registry: CollectorRegistry | None = None, pause_halfway_s: float = 0.0) -> None:
        self.pause_halfway_s = pause_halfway_s
        self._rooms: dict[int, SendRoom] = {}
        self._early: dict[int, tuple[float, EmbeddingWanted]] = {}
        self._aborted: dict[int, float] = {}  # room -> until when an abort is remembered
        self._concluded: list[Concluded] = []
        self._in_flight: dict[int, int] = {}  # room -> Mooncake writes in flight
        self._fence_owed: dict[int, set[str]] = {}  # room -> prefill endpoints owed an EmbeddingFenced
        super().__init__(config, slots, "embedding-sender", metrics_registry)  # threads start here

    # ---- the encode role's API ------------------------------------------------------------

    def begin(self, room: int) -> bool:
        return self.begin_all([room]) is None

    def begin_all(self, rooms: list[int], owner: int | None = None) -> int | None:
        """Opens every room of one call (`owner`), or none: the first room already open (or twice in
        `rooms`), or None once all are open. Checked before anything opens, so a refused call leaves
        nothing behind."""
        now = time.monotonic()
        with self.lock:
            seen: set[int] = set()
            for room in rooms:
                if room in self._rooms or room in seen:
                    return room
                seen.add(room)
            for room in rooms:
                self._open_locked(room, now, owner)
            return None

    def close_rooms(self, owner: int, rooms: list[int], reason: str) -> list[int]:
        """Closes the rooms of `rooms` that call `owner` opened and that are still open (a room being
        written is left to its write): the rooms closed. A prefill that already asked for one is told it failed."""
        with self.lock:
            closed = []
            for room in rooms:
                state = self._rooms.get(room)
                if state is not None and state.owner == owner and not state.done and not state.writing:
                    self._conclude_locked(state, False, reason)
                    closed.append(room)
            return closed

    def send(self, chunk: EmbeddingChunk) -> bool:
        """False if the room is gone (failed, aborted): the chunk's slot is the caller's again."""
        with self.lock:
            state = self._rooms.get(chunk.room)
            if state is None or state.done or state.chunk is not None:
                return False
            state.chunk = chunk
            state.ready_at = time.monotonic()
            self._maybe_write_locked(state)
            return True

    def fail(self, room: int, reason: str) -> None:
        with self.lock:
            state = self._rooms.get(room)
            if state is not None and not state.done and not state.writing:
                self._conclude_locked(state, False, reason)

    def concluded(self) -> list[Concluded]:
        with self.lock:
            out, self._concluded = self._concluded, []
            return out

    def stats(self) -> dict[str, int]:
        with self.lock:
            partly = sum(1 for r in self._rooms.values() if r.chunk is not None and 0 < r.written < r.chunk.nbytes)
            return {"rooms": len(self._rooms), "early": len(self._early), "concluded": len(self._concluded),
                    "writing": sum(1 for r in self._rooms.values() if r.writing), "partly_written": partly,
                    "writes_in_flight": sum(self._in_flight.values())}

    # ---- internals (lock held) --------------------------------------------------------------

    def _open_locked(self, room: int, now: float, owner: int | None) -> None:
        self._rooms[room] = SendRoom(room, now, owner)
        if room in self._aborted:
            self._conclude_locked(self._rooms[room], False, "aborted by the prefill")
            return
        early = self._early.pop(room, None)
        if early is not None:
            self._rooms[room].wanted = early[1]

    def _maybe_write_locked(self, state: SendRoom) -> None:
        want, chunk = state.wanted, state.chunk
        if want is None or chunk is None or state.writing or state.done:
            return
        problem = expected_problem(chunk, want, self.slots.buffer.element_size())
        if problem:
            self._conclude_locked(state, False, problem)
            return
        state.writing = True
        self.submit(lambda: self._write(state, chunk, want))

    def _write(self, state: SendRoom, chunk: EmbeddingChunk, want: EmbeddingWanted) -> None:
        """Writer thread: the Mooncake write (in two halves with `pause_halfway_s`), then the status (off the lock)."""
        half = chunk.nbytes // 2 if self.pause_halfway_s > 0 else 0
        pieces = [(0, half), (half, chunk.nbytes - half)] if half else [(0, chunk.nbytes)]
        code = 0
        for i, (start, length) in enumerate(pieces):
            if i:  # tests: a kill or a freeze during the pause lands mid-write
                log.info("embedding room %d: %d of %d bytes written, pausing %.1f s", state.room, start,
                         chunk.nbytes, self.pause_halfway_s)
                time.sleep(self.pause_halfway_s)
            refused = self._begin_write(state, want)
            if refused:
                with self.lock:
                    state.writing = False
                    if not state.done:
                        self._conclude_locked(state, False, refused)
                return
            code = -1
            try:
                code = self.engine.write(want.session, [self.slots.slot_ptr(chunk.slot) + start],
                                         [want.dst_ptr + start], [length])
            finally:
                self._end_write(state, start + length if code == 0 else start)
            if code != 0:
                break
        with self.lock:
            state.writing = False
            if state.done:
                return
            if code != 0:
                self._conclude_locked(state, False, f"Mooncake write of {chunk.nbytes} bytes failed ({code})")
                return
            seconds = time.monotonic() - state.ready_at if state.ready_at is not None else None
            self.metrics.item_done("encoder", True, chunk.nbytes, seconds)
            self._conclude_locked(state, True, "")

    def _begin_write(self, state: SendRoom, want: EmbeddingWanted) -> str:
        """Why no write may start for the room now ("" if one may: it is counted until `_end_write`)."""
        with self.lock:
            if state.done or state.room in self._aborted:
                return "aborted by the prefill"
            late = time.time() - want.write_by
            if late >= 0:
                return f"the prefill's write-by deadline passed {late:.1f}s ago: nothing more is written"
            self._in_flight[state.room] = self._in_flight.get(state.room, 0) + 1
            return ""

    def _end_write(self, state: SendRoom, written: int) -> None:
        """A counted write returned; the fence answers owed for its room go out once none is left."""
        with self.lock:
            state.written = written
            left = self._in_flight[state.room] - 1
            if left:
                self._in_flight[state.room] = left
                return
            del self._in_flight[state.room]
            for endpoint in self._fence_owed.pop(state.room, set()):
                self.send_control(endpoint, EmbeddingFenced(state.room, self.endpoint, self.instance_id))

    def _conclude_locked(self, state: SendRoom, ok: bool, reason: str) -> None:
        state.done = True
        if not ok:
            log.info("embedding room %d failed: %s", state.room, reason)
            self.metrics.item_done("encoder", False, 0, None)
        if state.wanted is not None:
            rows = state.chunk.rows if state.chunk is not None else 0
            self.send_control(state.wanted.reply_to, EmbeddingStatus(state.room, self.endpoint, self.instance_id,
                                                             LANDED if ok else FAILED, rows, reason))
        del self._rooms[state.room]
        self._concluded.append(Concluded(state.room, ok, reason, state.chunk.slot if state.chunk else None))

    def on_message_locked(self, msg: ControlMessage, now: float) -> None:
        if isinstance(msg, EmbeddingWanted):
            state = self._rooms.get(msg.room)
            if state is None:
                if msg.room in self._aborted:
                    return
                self._early[msg.room] = (now, msg)  # the room's image may not have arrived yet
                return
            if state.wanted is not None:
                self._conclude_locked(state, False, f"second EmbeddingWanted for room {msg.room}")
                return
            state.wanted = msg
            self._maybe_write_locked(state)
        elif isinstance(msg, EmbeddingAbort):
            self._early.pop(msg.room, None)
            self._aborted[msg.room] = now + self.config.transfer_bootstrap_timeout_s
            state = self._rooms.get(msg.room)
            if state is not None and not state.writing:
                state.wanted = None  # no status back: the prefill gave up
                self._conclude_locked(state, False, f"aborted by the prefill: {msg.reason}")
            # No write for the room starts from now on; answer once the one in flight (if any) returned.
            if msg.room in self._in_flight:
                self._fence_owed.setdefault(msg.room, set()).add(msg.reply_to)
            else:
                self.send_control(msg.reply_to, EmbeddingFenced(msg.room, self.endpoint, self.instance_id))

    def on_tick_locked(self, now: float) -> None:
        horizon = now - self.config.transfer_bootstrap_timeout_s
        for room, (at, _) in list(self._early.items()):
            if at < horizon:
                del self._early[room]
        for room, until in list(self._aborted.items()):
            if until < now:
                del self._aborted[room]
        for state in list(self._rooms.values()):
            if state.wanted is None and state.created < horizon:  # no prefill ever asked for it
                self._conclude_locked(state, False, "no prefill asked for the room's rows in time")

    def on_close_locked(self) -> None:
        for state in list(self._rooms.values()):
            if not state.writing:
                self._conclude_locked(state, False, "encoder shutting down")
