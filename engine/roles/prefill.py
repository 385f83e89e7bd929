"""The prefill role: run the prompt, sample the first token, ship KV + aux to decode, finish.

Each request arrives with the room the router drew. Its sender is created and initialised at
once, and the request waits, computing nothing, until its decode has reserved pages and sent the
metadata (the room leaves Bootstrapping): SGLang's order, so a decode short of pages holds
requests back here instead of filling this engine with KV nobody can receive yet. With
`--no-prefill-waits-for-decode` the prompt is scheduled at once instead: it computes while the
decode reserves pages, and what is sent before the metadata waits in the room (vLLM's order: the
decode's admission overlaps the compute instead of preceding it). After each prefill chunk the complete
pages go out (chunked prefill sends as it goes); the last pages and the aux data (first token,
its logprob, cached-token count) go once the first token is sampled. The request is then parked,
holding its pages, until the room reaches Success (the pages go to the prefix cache) or Failed
(the client gets the reason). A room that fails while Bootstrapping ends the request wherever
it is (waiting, computing or parked).

Its `bootstrapped` stamp is when the decode's metadata stopped holding anything back: its arrival
where the prompt waited for it or the KV was shipped before it, else the `shipped` stamp (the
router then attributes no decode admission to the request: engine/phase_timing.py).

Aux slots are this role's own (a request needs one from arrival, before it has a batch slot).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from splitserve.engine.engine import Engine
from splitserve.engine.phase_timing import BOOTSTRAPPED, SHIPPED, WRITTEN, mark
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import Role
from splitserve.engine.roles.kv_transfer_endpoint import HANDED_OVER, KVTransferEndpoint
from splitserve.transfer import AuxData, BootstrapServer, KVPoll, KVSender, TransferConfig

logger = logging.getLogger(__name__)

# The longest a step waits for the shipped KV's copies to be queued before it (queueing takes well under a
# millisecond): a worker that takes longer (a peer being mapped, a lane held up) holds the step no further, and
# those copies run after it.
COPIES_QUEUED_WAIT_S = 0.01


@dataclass
class PrefillState:
    """One request's sender, its aux slot and how many of its prompt pages have gone out."""

    sender: KVSender  # or its ReplicatedRoom on a tensor-parallel engine
    aux_index: int
    pages_sent: int = 0
    finish: FinishReason | None = None
    held_for_decode: bool = False  # computes nothing until the decode's metadata is here


def awaits_encoder(req: Request) -> bool:
    """Image rows an encoder computes are still to come: the embedding receiver holds the request
    until they land and hands it to the scheduler then; its chunks wait in the room for the decode's
    metadata (the order above holds for every other request)."""
    return any(item.embedding is None and item.pixels is None for item in req.images)


class PrefillRole(Role):
    """Prefill: the engine loop plus a KV sender per request and a bootstrap server."""

    name = "prefill"
    hands_over = HANDED_OVER

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.bootstrapping: dict[str, Request] = {}  # the decode's metadata not here yet (room Bootstrapping)
        self.parked: dict[str, Request] = {}  # first token sampled: waiting for the transfer to finish

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.endpoint = self.taken_over or KVTransferEndpoint(engine, self.config)
        self.free_aux = list(range(self.endpoint.aux.shape[0] - 1, -1, -1))
        self.bootstrap = BootstrapServer(self.config.transfer_host, self.config.bootstrap_port,
                                         key=self.config.transfer_control_key).start()
        self.bootstrap_addr = self.bootstrap.address
        self.endpoint.manager.publish_layout(self.bootstrap_addr)
        self.endpoint.start_worker_ranks(self.bootstrap_addr)  # tensor parallel: every rank publishes
        # CUDA IPC copies on the stream the steps use (no stream of their own): a copy queued after the next step
        # waits for its compute, so the next step is launched once they are queued, without overlap.
        self.copies_first = (self.config.prefill_copies_first and self.config.transfer_protocol == "cuda_ipc"
                             and self.endpoint.manager.copy_stream is None)
        logger.info("prefill bootstrap server on %s", self.bootstrap_addr)

    def health_info(self) -> dict[str, Any]:
        return {"bootstrap_host": self.bootstrap_addr.rsplit(":", 1)[0], "bootstrap_port": self.bootstrap.port}

    def on_arrival(self, req: Request) -> bool:
        if req.bootstrap_room is None:
            self.engine.finish(req, FinishReason.ERROR, "a prefill engine needs 'bootstrap_room' (send requests "
                                                        "through the router)")
            return True
        if not self.free_aux:
            self.engine.finish(req, FinishReason.ERROR, "prefill engine overloaded: every aux slot is taken by "
                                                        "a request waiting for its decode")
            return True
        # Here the request ends at its first token (the decode engine samples the rest): so no step is planned past
        # it, as the overlap scheduler would for a request whose token is on the device and that may emit more.
        req.params = dataclasses.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, 1))
        # A reused room raises RoomInUseError here: the engine fails this request, not the room's owner.
        sender = self.endpoint.new_sender(req.request_id, self.bootstrap_addr, req.bootstrap_room)
        encoder = awaits_encoder(req)
        req.role_state = PrefillState(sender, self.free_aux.pop(),
                                      held_for_decode=self.config.prefill_waits_for_decode and not encoder)
        sender.init(self.engine.kv.pages_for(len(req.prompt_ids)), req.role_state.aux_index)
        self.bootstrapping[req.request_id] = req
        if encoder:
            return False  # the embedding receiver holds it (one holder at a time: engine/role.py)
        return req.role_state.held_for_decode  # else the scheduler takes it now

    def allows_overlap(self) -> bool:
        # Overlap would launch the next step before this one's tokens are read, so before its KV is shipped: with
        # the copies on the engine's stream they would queue behind that step. On a stream of their own they run
        # beside it, which is safe because no page they read is written again while the room lives: a prefill
        # request holds its pages until the room is final, and it is never preempted (it parks at its first
        # token, so the scheduler's decodes, the only preemptions, have none of its rows).
        return not self.copies_first

    def before_launch(self) -> None:
        if self.copies_first and not self.endpoint.manager.wait_writes_issued(COPIES_QUEUED_WAIT_S):
            logger.debug("a shipped room's copies were not queued within %.0f ms: the next step goes first",
                         COPIES_QUEUED_WAIT_S * 1e3)

    def on_chunk_done(self, req: Request, computed_len: int) -> None:
        state: PrefillState = req.role_state
        # Only whole pages may go before the last chunk; the partial tail goes with the aux data.
        full = min(computed_len, len(req.prompt_ids)) // self.engine.kv.page_size
        if full > state.pages_sent and computed_len < len(req.prompt_ids):
            state.sender.send(req.pages[state.pages_sent:full], last_chunk=False)
            state.pages_sent = full

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        state: PrefillState = req.role_state
        self.endpoint.pack_aux(state.aux_index, AuxData(req.output_ids[0], req.first_token_logprob, req.cached_len))
        prompt_pages = self.engine.kv.pages_for(len(req.prompt_ids))
        state.sender.send(req.pages[state.pages_sent:prompt_pages], last_chunk=True)
        now = time.time()
        mark(req, SHIPPED, now)
        if req.request_id not in self.bootstrapping:
            mark(req, BOOTSTRAPPED, now)  # the metadata came while the prompt computed: it held nothing back
        state.pages_sent = prompt_pages
        state.finish = finish or FinishReason.LENGTH
        self.engine.park(req)
        self.parked[req.request_id] = req
        return True

    def poll(self) -> None:
        rids = list(self.bootstrapping) + [rid for rid in self.parked if rid not in self.bootstrapping]
        held = {**self.parked, **self.bootstrapping}
        states = self.endpoint.agree(rids, [held[rid].role_state.sender for rid in rids])
        for rid, status in zip(rids, states, strict=True):
            req = held[rid]
            with self.engine.request_fault(req, "polling its KV transfer"):
                if rid in self.bootstrapping:
                    self._bootstrap_polled(req, status)
                if rid in self.parked and rid not in self.bootstrapping:
                    self._transfer_polled(req, status)

    def _bootstrap_polled(self, req: Request, status: KVPoll) -> None:
        if status == KVPoll.Bootstrapping:
            return
        del self.bootstrapping[req.request_id]
        state: PrefillState = req.role_state
        if status == KVPoll.Failed:
            self.engine.finish(req, FinishReason.ERROR, f"KV transfer to decode failed before the decode's metadata "
                                                        f"arrived: {state.sender.failure_exception()}")
        elif state.held_for_decode:  # the decode's pages are reserved and its metadata is here: now compute
            mark(req, BOOTSTRAPPED)
            self.engine.scheduler.add(req)
        elif req.request_id in self.parked:  # shipped before the metadata came: the KV waited for it until now
            mark(req, BOOTSTRAPPED)

    def _transfer_polled(self, req: Request, status: KVPoll) -> None:
        state: PrefillState = req.role_state
        if status == KVPoll.Success:
            del self.parked[req.request_id]
            mark(req, WRITTEN, state.sender.succeeded_at)
            self.engine.finish(req, state.finish or FinishReason.LENGTH)
        elif status == KVPoll.Failed:
            del self.parked[req.request_id]
            self.engine.finish(req, FinishReason.ERROR, f"KV transfer to decode failed: "
                                                        f"{state.sender.failure_exception()}")

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.parked or self.bootstrapping else None

    def on_finish(self, req: Request) -> None:
        self.parked.pop(req.request_id, None)
        self.bootstrapping.pop(req.request_id, None)
        state = req.role_state
        if not isinstance(state, PrefillState):
            return
        req.role_state = None
        try:
            if state.sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                state.sender.abort("prefill request ended before its KV was sent")
        finally:
            state.sender.clear()
            # A write still in flight only reads this slot (and the request's pages): reusing them is safe.
            self.free_aux.append(state.aux_index)

    def held(self) -> dict[str, int]:
        stats = self.endpoint.manager.stats()
        return {"aux_slots": self.endpoint.aux.shape[0] - len(self.free_aux), "rooms": stats["rooms"],
                "writes_in_flight": stats["writes_in_flight"]}

    def state_info(self) -> dict[str, Any]:
        return {"kv_transfer_session": self.endpoint.session}

    def close(self) -> None:
        self.endpoint.close()
        self.bootstrap.stop()

    def hand_over(self) -> dict[str, Any]:
        self.bootstrap.stop()
        return {HANDED_OVER: self.endpoint}
