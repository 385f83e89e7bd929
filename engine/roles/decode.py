"""The decode role: reserve pages, receive the prompt's KV from prefill, then decode as usual.

A request arrives with the prefill's bootstrap address and the room. Decode gives it a slot
and pages for the whole prompt (reusing its own prefix cache: those tokens are not sent
again), starts a receiver, and parks the request. When the room reaches Success the first
token is read from the aux slot and the request joins the running batch; if it fails, the
client gets the reason and its pages and aux slot, once the metadata went out, are fenced: held
until no write of the prefill for that room can land any more (transfer/write_fence.py: the prefill
acknowledged, is known gone, or its write-by deadline passed), so a prefill that froze mid-transfer
and resumes cannot write into another request's KV. Fenced pages are counted
(`splitserve_kv_pages_fenced`) and bounded: past `transfer_fence_max_fraction` of the pool, a new
request from a prefill that holds fenced pages here fails at once; requests from others go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from splitserve.engine.engine import Engine
from splitserve.engine.phase_timing import ADMITTED, ARRIVED, mark
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import Role
from splitserve.engine.roles.kv_transfer_endpoint import HANDED_OVER, KVTransferEndpoint, aux_slot_count
from splitserve.transfer import KVPoll, KVReceiver, TransferConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fenced:
    """What a failed room held when its metadata had gone out: kept until its receiver says no
    write can land any more."""

    receiver: KVReceiver
    bootstrap_addr: str
    pages: list[int]
    aux_slot: int


class DecodeRole(Role):
    """Decode: the engine loop, fed by KV receivers instead of prefill."""

    name = "decode"
    hands_over = HANDED_OVER

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.pending: deque[Request] = deque()  # waiting for a slot and pages
        self.fenced: list[Fenced] = []  # pages and aux slots of failed rooms a write may still reach
        self.receiving: dict[str, Request] = {}
        self.metadata_sent: set[str] = set()  # requests whose pages a prefill may write into
        self.aux_of: dict[str, int] = {}  # request -> its aux slot (decode's own, fenced with its pages)

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.endpoint = self.taken_over or KVTransferEndpoint(engine, self.config)
        self.endpoint.start_worker_ranks(None)
        self.free_aux = list(range(aux_slot_count(engine.cfg) - 1, -1, -1))
        self.max_fenced_pages = int(self.config.transfer_fence_max_fraction * engine.kv.allocator.capacity)

    def on_arrival(self, req: Request) -> bool:
        if req.bootstrap_addr is None or req.bootstrap_room is None:
            self.engine.finish(req, FinishReason.ERROR, "a decode engine needs 'bootstrap_host', 'bootstrap_port' "
                                                        "and 'bootstrap_room' (send requests through the router)")
            return True
        self.pending.append(req)  # waiting (for a slot and pages), like a request in the scheduler's queue
        self._admit_pending()
        return True

    def _admit_pending(self) -> None:
        while self.pending and self.engine.kv.free_slots and self.free_aux:
            req = self.pending[0]
            with self.engine.request_fault(req, "reserving its pages and starting its KV receiver"):
                if self._refused_for_fences(req):
                    continue
                if not self._admit(req):
                    return  # wait for pages to come back

    def _refused_for_fences(self, req: Request) -> bool:
        """Past the fenced-page bound, a prefill that holds fenced pages here (it neither answered
        nor is known gone: frozen, or cut off) gets no new room: the request fails at once and the
        router retries it elsewhere, instead of the stuck prefill taking the whole pool."""
        fenced = self.fenced_pages
        if fenced <= self.max_fenced_pages:
            return False
        held = sum(len(f.pages) for f in self.fenced if f.bootstrap_addr == req.bootstrap_addr)
        if not held:
            return False
        # Still pending: on_finish takes it out and tells the prefill (abort_room) at once.
        self.engine.finish(req, FinishReason.ERROR, f"the prefill at {req.bootstrap_addr} holds {held} KV pages of "
                                                    f"failed transfers fenced on this decode ({fenced} in all, bound "
                                                    f"{self.max_fenced_pages}): it has not confirmed it stopped "
                                                    "writing; retry on another prefill")
        return True

    @property
    def fenced_pages(self) -> int:
        return sum(len(f.pages) for f in self.fenced)

    def _admit(self, req: Request) -> bool:
        kv = self.engine.kv
        prompt_len = len(req.prompt_ids)
        kv.admit(req, max_prefix_tokens=prompt_len - 1)
        decode_prefix_len = req.kv_len
        # Settled pages only: the prefill copies into them from outside this engine's stream, so none may be a
        # page that a step still queued here writes (one of a request that ended with a row in it).
        if not kv.grow(req, prompt_len, settled=True):
            kv.release(req)
            return False
        self.pending.popleft()
        self.engine.park(req)
        self.aux_of[req.request_id] = self.free_aux.pop()
        self._start_receiver(req, decode_prefix_len)
        return True

    def _start_receiver(self, req: Request, decode_prefix_len: int) -> None:
        # A reused room raises RoomInUseError here: only this request fails, the room's owner goes on.
        receiver = self.endpoint.new_receiver(req.request_id, req.bootstrap_addr, req.bootstrap_room)
        req.role_state = receiver
        self.receiving[req.request_id] = req
        receiver.init()
        self.metadata_sent.add(req.request_id)  # from here on the prefill may write into the pages
        receiver.send_metadata(req.pages[: self.engine.kv.pages_for(len(req.prompt_ids))],
                               self.aux_of[req.request_id], decode_prefix_len)
        mark(req, ADMITTED)

    def poll(self) -> None:
        self._release_fenced()
        self._admit_pending()
        self.poll_transfers()

    def poll_transfers(self) -> None:
        rids = list(self.receiving)
        states = self.endpoint.agree(rids, [self.receiving[rid].role_state for rid in rids])
        for rid, status in zip(rids, states, strict=True):
            req = self.receiving[rid]
            with self.engine.request_fault(req, "taking its KV in"):
                self._receiver_polled(req, status)

    def _receiver_polled(self, req: Request, status: KVPoll) -> None:
        receiver: KVReceiver = req.role_state
        if status == KVPoll.Success:
            mark(req, ARRIVED)
            self.receiving.pop(req.request_id)
            self.metadata_sent.discard(req.request_id)  # every write landed: nothing more can
            aux_slot = self.aux_of.pop(req.request_id)
            aux = self.endpoint.aux_reader.read(aux_slot)  # not waiting for the forward pass in flight
            self.free_aux.append(aux_slot)
            receiver.clear()
            req.role_state = None
            req.kv_len = len(req.prompt_ids)
            req.cached_len = aux.cached_tokens
            self.engine.scheduler.add_running(req)
            self.engine.append_token(req, aux.first_token_id, time.monotonic(),
                                     [aux.first_token_logprob] if req.params.logprobs is not None else None)
        elif status == KVPoll.Failed:
            self.receiving.pop(req.request_id)
            exc = receiver.failure_exception()
            self.engine.finish(req, FinishReason.ERROR, f"KV transfer from prefill failed: {exc}")

    def idle_poll_interval(self) -> float | None:
        if self.receiving or self.pending:
            return 0.002
        return 0.05 if self.fenced else None

    def on_finish(self, req: Request) -> None:
        self.receiving.pop(req.request_id, None)
        if req in self.pending:
            self.pending.remove(req)
            # No receiver yet: tell the prefill side directly, or its sender would hold the
            # prompt's pages until its bootstrap timeout.
            self.endpoint.manager.abort_room(req.bootstrap_room, "decode request ended before it got KV pages",
                                             bootstrap_addr=req.bootstrap_addr)
        receiver = req.role_state  # a KVReceiver, or its ReplicatedRoom on a tensor-parallel engine
        req.role_state = None
        aux_slot = self.aux_of.pop(req.request_id, None)
        if req.request_id in self.metadata_sent:
            # Failed, aborted or timed out after the metadata went out: a write may still land.
            self.metadata_sent.discard(req.request_id)
            self._fence_own_pages(req, receiver, aux_slot)
        elif aux_slot is not None:
            self.free_aux.append(aux_slot)
        if receiver is not None:
            try:
                if receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                    receiver.abort("decode request ended before its KV arrived")
            finally:
                receiver.clear()

    def _fence_own_pages(self, req: Request, receiver: KVReceiver, aux_slot: int) -> None:
        """The prefill may still write into this request's pages and aux slot (a chunk in flight
        when the room failed, or a prefill declared dead that is only frozen and resumes): they
        stay out of use until the receiver says no write can land, rather than go to another
        request whose KV that late write would corrupt."""
        shared = req.kv_len // self.engine.kv.page_size  # the decode's own prefix-cache pages: never written
        own, req.pages = req.pages[shared:], req.pages[:shared]
        self.fenced.append(Fenced(receiver, req.bootstrap_addr, own, aux_slot))
        self.engine.metrics.kv_fenced.set(self.fenced_pages)

    def _release_fenced(self) -> None:
        if not self.fenced:
            return
        kept = []
        for entry in self.fenced:
            if entry.receiver.no_write_can_land():
                self.engine.kv.allocator.free(entry.pages)
                self.free_aux.append(entry.aux_slot)
            else:
                kept.append(entry)
        self.fenced = kept
        self.engine.metrics.kv_fenced.set(self.fenced_pages)

    def held(self) -> dict[str, int]:
        stats = self.endpoint.manager.stats()
        return {"aux_slots": aux_slot_count(self.engine.cfg) - len(self.free_aux), "pending": len(self.pending),
                "fenced_pages": self.fenced_pages, "rooms": stats["rooms"], "fences": stats["fences"]}

    def state_info(self) -> dict[str, Any]:
        return {"kv_transfer_session": self.endpoint.session}

    def close(self) -> None:
        self.endpoint.close()

    def hand_over(self) -> dict[str, Any]:
        return {HANDED_OVER: self.endpoint}
