"""The prefill role: run the prompt, sample the first token, ship KV + aux to decode, finish.

Each request arrives with the room the router drew. Its sender is created at once; after each
prefill chunk the complete pages go out (chunked prefill sends as it goes); the last pages
and the aux data (first token, its logprob, cached-token count) go once the first token is
sampled. The request is then parked, holding its pages, until the room reaches Success (the
pages go to the prefix cache) or Failed (the client gets the reason).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import Role
from splitserve.engine.roles.kv_transfer_endpoint import KVTransferEndpoint
from splitserve.transfer import AuxData, BootstrapServer, KVPoll, KVSender, TransferConfig

logger = logging.getLogger(__name__)


@dataclass
class PrefillState:
    """One request's sender and how many of its prompt pages have gone out."""

    sender: KVSender  # or its ReplicatedRoom on a tensor-parallel engine
    pages_sent: int = 0
    initialised: bool = False
    finish: FinishReason | None = None


class PrefillRole(Role):
    """Prefill: the engine loop plus a KV sender per request and a bootstrap server."""

    name = "prefill"

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.parked: dict[str, Request] = {}

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.endpoint = KVTransferEndpoint(engine, self.config)
        self.bootstrap = BootstrapServer(self.config.transfer_host, self.config.bootstrap_port,
                                         key=self.config.transfer_control_key).start()
        self.bootstrap_addr = self.bootstrap.address
        self.endpoint.manager.publish_layout(self.bootstrap_addr)
        self.endpoint.start_worker_ranks(self.bootstrap_addr)  # tensor parallel: every rank publishes
        logger.info("prefill bootstrap server on %s", self.bootstrap_addr)

    def health_info(self) -> dict[str, Any]:
        return {"bootstrap_host": self.bootstrap_addr.rsplit(":", 1)[0], "bootstrap_port": self.bootstrap.port}

    def on_arrival(self, req: Request) -> bool:
        if req.bootstrap_room is None:
            self.engine.finish(req, FinishReason.ERROR, "a prefill engine needs 'bootstrap_room' (send requests "
                                                        "through the router)")
            return True
        req.role_state = PrefillState(self.endpoint.new_sender(req.request_id, self.bootstrap_addr,
                                                               req.bootstrap_room))
        return False

    def _ensure_init(self, req: Request, state: PrefillState) -> None:
        if not state.initialised:
            state.sender.init(self.engine.kv.pages_for(len(req.prompt_ids)), req.slot)
            state.initialised = True

    def on_chunk_done(self, req: Request, computed_len: int) -> None:
        state: PrefillState = req.role_state
        self._ensure_init(req, state)
        # Only whole pages may go before the last chunk; the partial tail goes with the aux data.
        full = min(computed_len, len(req.prompt_ids)) // self.engine.kv.page_size
        if full > state.pages_sent and computed_len < len(req.prompt_ids):
            state.sender.send(req.pages[state.pages_sent:full], last_chunk=False)
            state.pages_sent = full

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        state: PrefillState = req.role_state
        self._ensure_init(req, state)
        self.endpoint.pack_aux(req.slot, AuxData(req.output_ids[0], req.first_token_logprob, req.cached_len))
        prompt_pages = self.engine.kv.pages_for(len(req.prompt_ids))
        state.sender.send(req.pages[state.pages_sent:prompt_pages], last_chunk=True)
        state.pages_sent = prompt_pages
        state.finish = finish or FinishReason.LENGTH
        self.engine.park(req)
        self.parked[req.request_id] = req
        return True

    def poll(self) -> None:
        rids = list(self.parked)
        states = self.endpoint.agree(rids, [self.parked[rid].role_state.sender for rid in rids])
        for rid, status in zip(rids, states, strict=True):
            req = self.parked[rid]
            state: PrefillState = req.role_state
            if status == KVPoll.Success:
                self.parked.pop(rid)
                self.engine.finish(req, state.finish or FinishReason.LENGTH)
            elif status == KVPoll.Failed:
                self.parked.pop(rid)
                exc = state.sender.failure_exception()
                self.engine.finish(req, FinishReason.ERROR, f"KV transfer to decode failed: {exc}")

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.parked else None

    def on_finish(self, req: Request) -> None:
        self.parked.pop(req.request_id, None)
        state = req.role_state
        if isinstance(state, PrefillState):
            if state.sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                state.sender.abort("prefill request ended before its KV was sent")
            state.sender.clear()
            req.role_state = None

    def close(self) -> None:
        self.endpoint.close()
        self.bootstrap.stop()
