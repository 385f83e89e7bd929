"""The decode role: reserve pages, receive the prompt's KV from prefill, then decode as usual.

A request arrives with the prefill's bootstrap address and the room. Decode gives it a slot
and pages for the whole prompt (reusing its own prefix cache: those tokens are not sent
again), starts a receiver, and parks the request. When the room reaches Success the first
token is read from the aux slot and the request joins the running batch; if it fails, its
pages are freed and the client gets the reason.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import Role
from splitserve.engine.roles.kv_transfer_endpoint import KVTransferEndpoint
from splitserve.transfer import KVPoll, KVReceiver, TransferConfig, unpack_aux

logger = logging.getLogger(__name__)


class DecodeRole(Role):
    """Decode: the engine loop, fed by KV receivers instead of prefill."""

    name = "decode"

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.pending: deque[Request] = deque()  # waiting for a slot and pages
        self.quarantine: deque[tuple[float, list[int]]] = deque()  # (free after, pages) of aborted transfers
        self.receiving: dict[str, Request] = {}

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.endpoint = KVTransferEndpoint(engine, self.config)
        self.endpoint.start_worker_ranks(None)

    def on_arrival(self, req: Request) -> bool:
        if req.bootstrap_addr is None or req.bootstrap_room is None:
            self.engine.finish(req, FinishReason.ERROR, "a decode engine needs 'bootstrap_host', 'bootstrap_port' "
                                                        "and 'bootstrap_room' (send requests through the router)")
            return True
        self.engine.park(req)
        self.pending.append(req)
        self._admit_pending()
        return True

    def _admit_pending(self) -> None:
        kv = self.engine.kv
        while self.pending and kv.free_slots:
            req = self.pending[0]
            prompt_len = len(req.prompt_ids)
            kv.admit(req, max_prefix_tokens=prompt_len - 1)
            decode_prefix_len = req.kv_len
            if not kv.grow(req, prompt_len):
                kv.release(req)
                return  # wait for pages to come back
            self.pending.popleft()
            receiver = self.endpoint.new_receiver(req.request_id, req.bootstrap_addr, req.bootstrap_room)
            receiver.init()
            receiver.send_metadata(req.pages[: kv.pages_for(prompt_len)], req.slot, decode_prefix_len)
            req.role_state = receiver
            self.receiving[req.request_id] = req

    def poll(self) -> None:
        self._release_quarantine()
        self._admit_pending()
        rids = list(self.receiving)
        states = self.endpoint.agree(rids, [self.receiving[rid].role_state for rid in rids])
        for rid, status in zip(rids, states, strict=True):
            req = self.receiving[rid]
            receiver: KVReceiver = req.role_state
            if status == KVPoll.Success:
                self.receiving.pop(rid)
                aux = unpack_aux(self.endpoint.aux, req.slot)
                receiver.clear()
                req.kv_len = len(req.prompt_ids)
                req.cached_len = aux.cached_tokens
                self.engine.scheduler.add_running(req)
                self.engine.append_token(req, aux.first_token_id, time.monotonic(),
                                         [aux.first_token_logprob] if req.params.logprobs is not None else None)
            elif status == KVPoll.Failed:
                self.receiving.pop(rid)
                exc = receiver.failure_exception()
                self.engine.finish(req, FinishReason.ERROR, f"KV transfer from prefill failed: {exc}")

    def idle_poll_interval(self) -> float | None:
        if self.receiving or self.pending:
            return 0.002
        return 0.05 if self.quarantine else None

    def on_finish(self, req: Request) -> None:
        self.receiving.pop(req.request_id, None)
        if req in self.pending:
            self.pending.remove(req)
            # No receiver yet: tell the prefill side directly, or its sender would hold the
            # prompt's pages until its bootstrap timeout.
            self.endpoint.manager.abort_room(req.bootstrap_room, "decode request ended before it got KV pages",
                                             bootstrap_addr=req.bootstrap_addr)
        receiver = req.role_state  # a KVReceiver, or its ReplicatedRoom on a tensor-parallel engine
        if receiver is not None:
            state = receiver.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                receiver.abort("decode request ended before its KV arrived")
            if state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                self._quarantine_own_pages(req)
            receiver.clear()
            req.role_state = None

    def _quarantine_own_pages(self, req: Request) -> None:
        """The prefill may still be writing into this request's pages (a chunk already in flight
        when the abort reached it): keep them out of the allocator for a while rather than hand
        them to another request whose KV that late write would corrupt."""
        shared = req.kv_len // self.engine.kv.page_size  # the decode's own prefix-cache pages: never written
        own, req.pages = req.pages[shared:], req.pages[:shared]
        if own:
            self.quarantine.append((time.monotonic() + self.config.heartbeat_timeout_s, own))

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self.engine.kv.allocator.free(self.quarantine.popleft()[1])

    def close(self) -> None:
        self.endpoint.close()
