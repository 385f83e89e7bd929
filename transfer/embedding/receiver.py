"""The prefill side: receive each staged request's image rows into leased slots.

`stage(rid, items)` leases a slot per item (or waits for one) and tells each item's encoder where
to write (`EmbeddingWanted`); `poll()` gives each staged request's code (0 failed or timed out,
1 receiving, 2 every item landed); `settle(codes)` acts on the replica-agreed codes (the MIN over
tensor-parallel ranks, as for KV; the codes of `poll` on one rank) and returns the landed
requests with the slot each item landed in, and the failed ones with their reason; `release(slots)`
frees slots once their rows are copied into the prompt's embeddings.

A failed or dropped item's slot is fenced (write_fence.py, the KV pages' `WriteFence`): it stays
out of use until the encoder answered `EmbeddingFenced` (the abort is repeated every heartbeat
interval; the encoder answers once no write of its for the room is in flight, and starts none
after the abort), or is known gone (a refused connection to its control endpoint, checked every
second once the fence is older than a heartbeat timeout; another instance there), or the item's
write-by deadline (its staging deadline, sent in `EmbeddingWanted`: the encoder starts no write
after it) plus `--transfer-fence-grace-s` passed. An encoder frozen mid-write (SIGSTOP) that
resumes can so never write into a slot given to another item.

Fenced slots are bounded as the decode's fenced KV pages are (`--transfer-fence-max-fraction`, of
the slots here): past it, an item whose encoder holds fenced slots fails before it takes a slot
(`splitserve_embedding_items_refused`), so a frozen or cut-off encoder cannot end with every slot;
items for other encoders go on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from splitserve.transfer.config import TransferConfig
from splitserve.transfer.control_messages import ControlMessage
from splitserve.transfer.embedding.endpoint import EmbeddingEndpoint
from splitserve.transfer.embedding.messages import EmbeddingAbort, EmbeddingFenced, EmbeddingStatus, EmbeddingWanted
from splitserve.transfer.embedding.slots import EmbeddingSlots
from splitserve.transfer.write_fence import WriteFence, nothing_listens

log = logging.getLogger(__name__)

FAILED, RECEIVING, LANDED = 0, 1, 2
FENCE_CHECK_S = 1.0  # how often a silent fenced encoder's control endpoint is tried
FENCE_QUERY = "fence: the item failed on prefill; answer once no write for it is in flight"


@dataclass(frozen=True)
class WantedItem:
    """One image item of a request: its room at encoder `encoder` (control endpoint), `rows` rows."""

    room: int
    encoder: str
    rows: int
    digest: str


@dataclass
class ItemState:
    item: WantedItem
    deadline: float  # monotonic; the encoder's write-by deadline is this one on the wall clock
    slot: int | None = None
    state: int = RECEIVING
    reason: str = ""


@dataclass
class Staged:
    rid: str
    items: list[ItemState]
    staged_at: float
    deadline: float
    reason: str = field(default="")

    @property
    def code(self) -> int:
        return min(i.state for i in self.items)


class EmbeddingReceiver(EmbeddingEndpoint):
    """The prefill engine's embedding transfer (one per prefill rank)."""

    def __init__(self, config: TransferConfig, slots: EmbeddingSlots, timeout_s: float,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.timeout_s = timeout_s
        self.dtype_name = str(slots.dtype).removeprefix("torch.")
        self._staged: dict[str, Staged] = {}
        self._by_room: dict[int, ItemState] = {}
        self._fences: dict[int, tuple[WriteFence, int]] = {}  # room -> its fence and fenced slot
        self._fence_check: threading.Thread | None = None
        self.max_fenced_slots = int(config.transfer_fence_max_fraction * slots.buffer.shape[0])
        super().__init__(config, slots, "embedding-receiver", metrics_registry)  # threads start here

    # ---- the prefill role's API -------------------------------------------------------------

    def stage(self, rid: str, items: list[WantedItem]) -> None:
        now = time.monotonic()
        with self.lock:
            deadline = now + self.timeout_s
            staged = Staged(rid, [ItemState(i, deadline) for i in items], now, deadline)
            self._staged[rid] = staged
            for st in staged.items:
                if st.item.rows > self.slots.max_rows:
                    self._fail_item_locked(st, f"{st.item.rows} rows do not fit a slot of {self.slots.max_rows}")
                    continue
                if st.item.room in self._by_room:
                    self._fail_item_locked(st, f"room {st.item.room} is already staged")
                    continue
                self._by_room[st.item.room] = st
                self.liveness.watch(st.item.encoder, "", now)
            self._lease_and_ask_locked(now)

    def poll(self) -> dict[str, int]:
        with self.lock:
            self._expire_locked(time.monotonic())
            return {rid: s.code for rid, s in self._staged.items()}

    def settle(self, codes: dict[str, int]) -> tuple[list[tuple[str, list[int]]], list[tuple[str, str]]]:
        """(landed: rid and each item's slot, in item order; failed: rid and why). Both leave staging."""
        landed, failed = [], []
        now = time.monotonic()
        with self.lock:
            for rid, code in codes.items():
                staged = self._staged.get(rid)
                if staged is None or code == RECEIVING:
                    continue
                if code == LANDED:
                    self._forget_locked(staged, failed=False)
                    landed.append((rid, [i.slot for i in staged.items]))  # type: ignore[misc]
                    rows = sum(i.item.rows for i in staged.items)
                    nbytes = rows * self.slots.hidden * self.slots.buffer.element_size()
                    self.metrics.item_done("prefill", True, nbytes, now - staged.staged_at)
                else:
                    reason = next((i.reason for i in staged.items if i.state == FAILED), "") or staged.reason
                    self._drop_locked(staged, reason or "failed on another rank")
                    failed.append((rid, reason or "failed on another rank"))
                    self.metrics.item_done("prefill", False, 0, None)
        return landed, failed

    def release(self, slots: list[int]) -> None:
        with self.lock:
            for slot in slots:
                self.slots.free(slot)

    def drop(self, rid: str, reason: str) -> None:
        """The request ended before its rows landed: the encoders are told, the slots held back."""
        with self.lock:
            staged = self._staged.get(rid)
            if staged is not None:
                self._drop_locked(staged, reason)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"staged": len(self._staged), "rooms": len(self._by_room), "watched_peers": len(self.liveness),
                    "fence_checks": int(self._fence_check is not None), **self.slots.counts()}

    # ---- internals (lock held) --------------------------------------------------------------

    def _lease_and_ask_locked(self, now: float) -> None:
        for st in self._by_room.values():
            if st.slot is not None or st.state != RECEIVING:
                continue
            refusal = self._fence_refusal_locked(st.item.encoder)
            if refusal:
                self._fail_item_locked(st, refusal)
                self.metrics.items_refused.inc()
                continue
            slot = self.slots.lease()
            if slot is None:
                return  # the next tick tries again
            st.slot = slot
            nbytes = st.item.rows * self.slots.hidden * self.slots.buffer.element_size()
            self.send_control(st.item.encoder, EmbeddingWanted(
                st.item.room, self.endpoint, self.instance_id, self.engine.session_id, self.slots.slot_ptr(slot),
                nbytes, st.item.rows, self.slots.hidden, self.dtype_name, st.item.digest,
                time.time() + (st.deadline - now)))

    def _fence_refusal_locked(self, encoder: str) -> str:
        """Why ``encoder`` gets no slot now ("" if it may): past the fenced-slot bound, an encoder
        that holds fenced slots here (it neither answered the abort nor is known gone) gets no more."""
        fenced = len(self._fences)
        if fenced <= self.max_fenced_slots:
            return ""
        held = sum(encoder in fence.pending for fence, _ in self._fences.values())
        if not held:
            return ""
        return (f"encoder {encoder} holds {held} embedding slots of failed items fenced on this prefill "
                f"({fenced} in all, bound {self.max_fenced_slots} of {self.slots.buffer.shape[0]}): it has not "
                "confirmed it stopped writing; retry later or with another encoder")

    def _fail_item_locked(self, st: ItemState, reason: str) -> None:
        if st.state == RECEIVING:
            st.state, st.reason = FAILED, reason

    def _drop_locked(self, staged: Staged, reason: str) -> None:
        for st in staged.items:
            if st.state != LANDED and st.slot is not None:  # an encoder done with the room ignores it
                self.send_control(st.item.encoder, EmbeddingAbort(st.item.room, self.endpoint, self.instance_id,
                                                                  reason))
        self._forget_locked(staged, failed=True)

    def _forget_locked(self, staged: Staged, failed: bool) -> None:
        self._staged.pop(staged.rid, None)
        for st in staged.items:
            if self._by_room.get(st.item.room) is st:
                del self._by_room[st.item.room]
            if failed and st.slot is not None and st.state == LANDED:
                self.slots.free(st.slot)  # the encoder's write returned: nothing more comes
            elif failed and st.slot is not None:
                self._fence_locked(st, st.slot)
        busy = {st.item.encoder for st in self._by_room.values()}
        for st in staged.items:
            if st.item.encoder not in busy:
                self.liveness.unwatch(st.item.encoder)

    def _fence_locked(self, st: ItemState, slot: int) -> None:
        """The item's EmbeddingWanted went out: its slot waits until no write of the encoder can land."""
        now = time.monotonic()
        encoder = st.item.encoder
        lift_at = st.deadline + self.config.transfer_fence_grace_s
        fence = WriteFence(st.item.room, "", {encoder: self.liveness.instance(encoder)}, now, lift_at,
                           next_query=now + self.config.transfer_heartbeat_interval_s)  # the abort just went out
        self.slots.fence(slot)
        self._fences[st.item.room] = (fence, slot)
        self.metrics.slots_fenced.inc()

    def _tend_fences_locked(self, now: float) -> None:
        for room, (fence, slot) in list(self._fences.items()):
            if fence.lifted(now):
                del self._fences[room]
                self.slots.unfence(slot)
                self.metrics.slots_fenced.dec()
                self.metrics.fences_total.labels(outcome=fence.outcome).inc()
                log.log(logging.WARNING if fence.outcome == "deadline" else logging.DEBUG,
                        "fence of embedding room %d lifted after %.1fs: %s", room, now - fence.created, fence.outcome)
                continue
            if now >= fence.next_query:
                fence.next_query = now + self.config.transfer_heartbeat_interval_s
                for endpoint in fence.pending:
                    self.send_control(endpoint, EmbeddingAbort(room, self.endpoint, self.instance_id, FENCE_QUERY))
            if now - fence.created > self.liveness.timeout_s and now >= fence.next_lookup:
                fence.next_lookup = now + FENCE_CHECK_S
                self._start_fence_check_locked()

    def _start_fence_check_locked(self) -> None:
        if self._fence_check is not None:
            return
        peers = {(e, i) for fence, _ in self._fences.values() for e, i in fence.pending.items()}
        self._fence_check = threading.Thread(target=self._check_fenced_encoders, args=(peers,), daemon=True,
                                             name="embedding-fence-check")
        self._fence_check.start()

    def _check_fenced_encoders(self, peers: set[tuple[str, str]]) -> None:
        """Thread: which silent encoders of fenced slots are known gone (nothing listens any more)."""
        gone = {(endpoint, instance) for endpoint, instance in peers if nothing_listens(endpoint)}
        with self.lock:
            self._fence_check = None
            for fence, _ in self._fences.values():
                for endpoint, instance in gone:
                    fence.peer_gone(endpoint, instance)

    def _expire_locked(self, now: float) -> None:
        for staged in self._staged.values():
            if staged.code == RECEIVING and now > staged.deadline:
                for st in staged.items:
                    self._fail_item_locked(st, f"timed out: the image rows did not arrive within {self.timeout_s:g} s")

    def on_heard_locked(self, endpoint: str, instance: str) -> None:
        for fence, _ in self._fences.values():
            fence.peer_seen(endpoint, instance)

    def on_message_locked(self, msg: ControlMessage, now: float) -> None:
        if isinstance(msg, EmbeddingFenced):
            entry = self._fences.get(msg.room)
            if entry is not None:
                entry[0].acknowledged(msg.reply_to)
            return
        if not isinstance(msg, EmbeddingStatus):
            return
        st = self._by_room.get(msg.room)
        if st is None or st.item.encoder != msg.reply_to or st.state != RECEIVING:
            return
        if msg.state == LANDED and msg.rows == st.item.rows:
            st.state = LANDED
        elif msg.state == LANDED:
            self._fail_item_locked(st, f"encoder wrote {msg.rows} rows, {st.item.rows} expected")
        else:
            self._fail_item_locked(st, f"encoder {msg.reply_to} failed the image: {msg.reason}")

    def on_tick_locked(self, now: float) -> None:
        self._expire_locked(now)
        self._tend_fences_locked(now)
        self._lease_and_ask_locked(now)

    def on_peer_dead_locked(self, endpoint: str) -> None:
        for st in self._by_room.values():
            if st.item.encoder == endpoint:
                self._fail_item_locked(st, f"encoder {endpoint} stopped answering")

    def on_close_locked(self) -> None:
        for st in self._by_room.values():
            self._fail_item_locked(st, "prefill shutting down")
