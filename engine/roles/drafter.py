"""The drafter role: serve the draft mesh and run the draft model ahead of every synced request.

Verifiers join over gRPC (draft_mesh/server.py) and send batches of `DraftSync` / `VerifyCommit`
/ `DraftClose` over ZeroMQ. Each synced request becomes an engine request `draft:<rank>:<id>`
whose prompt is the verifier's prompt and committed output; the engine decodes it greedily and
every token it drafts is streamed back at once (with the committed length it was drafted from
and its position), until it is as far past the last commit as the verifier asks (`DraftPace`, at
most `max_draft_ahead`); then the request is parked until the next commit. A commit that
disagrees with the drafts truncates the request to the committed prefix (its KV pages past it are
freed) and drafting continues from there.
A gap, an overlap or a malformed item quarantines that one request: it is closed and reported.

The drafter keeps the radix prefix cache (SpecConfig.drafter_prefix_cache; a request's KV is a
function of its tokens, drafted ones too, and a commit only cuts a request's own pages past its
committed length, never the prompt pages it shares): a DraftSync of a prompt the drafter has seen
prefills only what is not cached, as the verifier's own prefill does (on an H200 at batch 32 the
uncached prefill of 32 synced 129-token requests took two steps of 14 and 10 ms on the shared device,
most of a speculating stint's first 60 ms without drafts). It runs on the overlap scheduler
(`--no-drafter-overlap` turns it off: see SpecConfig.drafter_overlap): its next step is queued on
the device before the last one's token is read back, so on a GPU it shares with a verifier it holds
work whenever it gets the device (sharing it by time slices, a drafter that queued one step at a
time got one step per slice of the verifier's: 2.8 ms a draft against 0.9 ms alone).
Its requests' output limit is the drafting limit (`max_new_tokens` = committed + ahead), so no step
is queued past it. A commit that cuts a
request while its next token is on the device makes that token stale: it is dropped when it arrives
(`DraftState.stale`). A commit that runs past every token the host has is held (`DraftState.held`)
and compared with the tokens still on the device as they arrive, the next step queued meanwhile
from the device's token: an exact drafter's agrees, and it keeps its lead (dropping that token
threw away every step of a drafter one step ahead of the commits).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import zmq

from splitserve.draft_mesh.commit_segments import ProtocolViolation, apply_commit, check_tokens
from splitserve.draft_mesh.config import SpecConfig
from splitserve.draft_mesh.fingerprint import tokenizer_fingerprint
from splitserve.draft_mesh.leases import Lease, LeaseTable
from splitserve.draft_mesh.server import DrafterIdentity, DraftMeshService, start_mesh_server
from splitserve.draft_mesh.wire import WireError, decode_control, encode_frames
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import FinishReason, Request, RequestStatus, TokenOutput
from splitserve.engine.role import Role
from splitserve.engine.sampling_params import SamplingParams
from splitserve.proto import draft_mesh_pb2 as pb
from splitserve.transfer import TransferConfig

logger = logging.getLogger(__name__)

RECV_POLL_MS = 100
IDLE_POLL_S = 0.05  # how long the idle loop sleeps while verifiers hold leases (their ends are polled)
SEND_NOW_S = 1e-6  # ... and while drafted tokens wait in an outbox: go round to the next poll at once


def drafter_engine_config(cfg: EngineConfig, overlap: bool = True, prefix_cache: bool = True) -> EngineConfig:
    """The engine settings a drafter needs (see the module docstring); `overlap` is
    SpecConfig.drafter_overlap and `prefix_cache` SpecConfig.drafter_prefix_cache (the engine's own
    --disable-overlap and --disable-prefix-cache still turn them off)."""
    return dataclasses.replace(cfg, disable_prefix_cache=cfg.disable_prefix_cache or not prefix_cache,
                               disable_overlap=cfg.disable_overlap or not overlap)


def draft_key(verifier_rank: int, request_id: str) -> str:
    return f"draft:{verifier_rank}:{request_id}"


@dataclass
class DraftState:
    """One synced request on this drafter."""

    key: str
    request_id: str  # the verifier's id
    lease_id: str
    req: Request
    committed_len: int
    ahead: int  # drafts past the last commit before it waits
    admitted: bool = False
    stale: int = 0  # tokens still on the device that a commit made stale (dropped when they arrive)
    held: list[int] = field(default_factory=list)  # committed past the token on the device: applied when it arrives
    streamed: bool = False  # a tail of this request went to the verifier (it knows the drafter has taken it in)

    def limit_output(self, context_length: int) -> None:
        """The request's output limit is the drafting limit: the engine queues no step past it (under
        the overlap scheduler a step is queued before the last one's token is known)."""
        req = self.req
        req.params.max_new_tokens = max(1, min(self.committed_len + self.ahead, context_length) - len(req.prompt_ids))


@dataclass
class Outbox:
    """What goes back to one lease's verifier at the next flush."""

    tokens: list[pb.TailToken] = field(default_factory=list)
    quarantined: list[pb.Quarantined] = field(default_factory=list)


class DrafterRole(Role):
    """The draft-mesh server and the draft requests it runs on this engine."""

    name = "drafter"

    def __init__(self, spec: SpecConfig, transfer: TransferConfig, rank: int = 0) -> None:
        self.spec = spec
        self.key = transfer.transfer_control_key
        self.host = transfer.transfer_host
        self.rank = rank
        self.instance = secrets.token_hex(6)
        self.leases = LeaseTable(spec.draft_lease_ttl_s, spec.max_verifiers)
        self.states: dict[str, DraftState] = {}
        self.outboxes: dict[str, Outbox] = {}
        self.tail_sockets: dict[str, zmq.Socket] = {}
        self.quarantined_total = 0
        self.drafted_total = 0
        self.synced_total = 0  # DraftSyncs taken in, ever
        self.dropped_messages = 0
        self.stale_dropped = 0  # tokens drafted by a step in flight when a commit cut what it followed
        self.held_commits = 0  # commits held for the token on the device (they ran past the host's)
        self.held_kept = 0  # of those, the token on the device was the committed one
        self._stop = threading.Event()

    # ---- setup and teardown ---------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        self.vocab_size = engine.model_cfg.vocab_size
        if not self.spec.drafter_cudnn_attention:  # no cuDNN plan per new prompt length (SpecConfig)
            import torch

            torch.backends.cuda.enable_cudnn_sdp(False)
        # The verifier's kernels: a draft does not depend on how many requests share the drafter's step
        # (a drafter that is a prefix of the target then agrees with it bit for bit at every batch).
        engine.use_row_invariant_rows(self.spec.row_invariant_rows)
        self.zmq = zmq.Context()
        self.control = self.zmq.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        if self.spec.draft_data_port:
            self.control.bind(f"tcp://{self.host}:{self.spec.draft_data_port}")
        else:
            self.control.bind_to_random_port(f"tcp://{self.host}")
        self.control_endpoint = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        identity = DrafterIdentity(self.rank, self.instance, tokenizer_fingerprint(engine.tokenizer),
                                   self.vocab_size, self.control_endpoint, self.spec.max_draft_ahead)
        self.service = DraftMeshService(identity, self.leases, self.key, running=False)  # Joins from the first poll
        self.grpc_server, self.mesh_port = start_mesh_server(self.service, self.host, self.spec.draft_mesh_port)
        self._receiver = threading.Thread(target=self._receive, name="draft-control-recv", daemon=True)
        self._receiver.start()
        logger.info("drafter rank %d: DraftMesh on %s:%d, control on %s", self.rank, self.host, self.mesh_port,
                    self.control_endpoint)

    def close(self) -> None:
        self.service.draining = True
        self.grpc_server.stop(grace=0.5).wait(2)
        self._stop.set()
        self._receiver.join(timeout=2)
        for sock in self.tail_sockets.values():
            sock.close(linger=0)
        self.control.close(linger=0)
        self.zmq.term()

    def serves_structured_outputs(self) -> bool:
        """A drafter's requests are verifiers' syncs, never a client's: its engine builds no grammar compiler
        (xgrammar's tokenizer tables, seconds of CPU at a start that is already the slowest in a group)."""
        return False

    def health_info(self) -> dict[str, Any]:
        return {"draft_mesh_port": self.mesh_port, "draft_control_endpoint": self.control_endpoint,
                "drafter_rank": self.rank, "leases": len(self.leases), "draft_requests": len(self.states),
                "synced": self.synced_total, "drafted": self.drafted_total, "quarantined": self.quarantined_total,
                "dropped_messages": self.dropped_messages, "stale_dropped": self.stale_dropped,
                "held_commits": self.held_commits, "held_kept": self.held_kept}

    def idle_poll_interval(self) -> float | None:
        # Under the overlap scheduler a request's last draft before its limit is taken in by a loop turn
        # that planned no step (none was queued past the limit): the loop would sleep before the poll
        # that sends it (on the H200 the exact drafter at batch 1 then drafted 1-12 tokens in a run).
        if any(box.tokens or box.quarantined for box in self.outboxes.values()):
            return SEND_NOW_S
        return IDLE_POLL_S if len(self.leases) else None

    # ---- the receive thread: parse and authenticate, then hand over to the loop ---------------

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(RECV_POLL_MS):
                    continue
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("draft control socket failed")
                continue
            try:
                batch = decode_control(frames, self.key)
            except WireError as exc:
                self.dropped_messages += 1
                logger.warning("dropped a draft control message: %s", exc)
                continue
            self.engine.call_soon(lambda b=batch: self.apply(b))

    # ---- the loop thread ------------------------------------------------------------------------

    def apply(self, batch: pb.DraftControlBatch) -> None:
        """Applies one verifier's batch, item by item; a bad item quarantines its request only."""
        lease = self.leases.get(batch.lease_id)
        if lease is None:
            self.dropped_messages += 1
            logger.warning("dropped a draft control batch of unknown lease %r", batch.lease_id)
            return
        for item in batch.items:
            kind = item.WhichOneof("item")
            body = getattr(item, kind) if kind else None
            rid = body.request_id if body is not None else ""
            try:
                if kind == "sync":
                    self._sync(lease, item.sync)
                elif kind == "commit":
                    self._commit(lease, item.commit)
                elif kind == "close":
                    self._close(draft_key(lease.verifier_rank, rid), None)
                elif kind == "pace":
                    self._pace(lease, item.pace)
                else:
                    raise ProtocolViolation("an item with no sync, commit or close")
            except ProtocolViolation as exc:
                self._quarantine(lease, rid, str(exc))

    def _sync(self, lease: Lease, sync: pb.DraftSync) -> None:
        key = draft_key(lease.verifier_rank, sync.request_id)
        self._close(key, None)  # a re-sync replaces what was held
        if not sync.request_id or not sync.prompt_ids:
            raise ProtocolViolation("DraftSync needs a request_id and a prompt")
        sequence = list(sync.prompt_ids) + list(sync.output_ids)
        check_tokens(sequence, self.vocab_size, "DraftSync")
        if len(sequence) > self.engine.max_prompt_tokens:
            raise ProtocolViolation(f"DraftSync of {len(sequence)} tokens; this drafter takes at most "
                                    f"{self.engine.max_prompt_tokens}")
        params = SamplingParams(max_new_tokens=self.engine.context_length, temperature=0.0, ignore_eos=True)
        req = Request(key, sequence, params, lambda out, k=key: self._on_output(k, out))
        ahead = min(self.spec.max_draft_ahead, max(lease.draft_tokens, 1) * 2 + 1)  # as DraftPolicy.ahead
        state = self.states[key] = DraftState(key, sync.request_id, lease.lease_id, req, len(sequence), ahead)
        state.limit_output(self.engine.context_length)
        self.synced_total += 1
        self.engine.submit(req)  # admitted in this same inbox drain, before the next step

    def _commit(self, lease: Lease, commit: pb.VerifyCommit) -> None:
        key = draft_key(lease.verifier_rank, commit.request_id)
        state = self.states.get(key)
        if state is None or state.lease_id != lease.lease_id:
            raise ProtocolViolation("VerifyCommit for a request that is not synced")
        req = state.req
        sequence = req.all_ids + state.held
        outcome = apply_commit(sequence, state.committed_len, commit.pre_verify_committed_len,
                               list(commit.tokens), self.vocab_size)
        on_device = req.status is RequestStatus.RUNNING and req.pending_len == 0  # its next token
        if state.held or (on_device and outcome.truncated and outcome.keep == len(sequence)):
            # The commit runs past every token the host has while the next one is still on the device
            # (an exact drafter's is the committed token): held, compared with the device's tokens as they come.
            self.held_commits += not state.held
            state.held += outcome.append
        elif outcome.truncated:
            if on_device:
                state.stale += 1  # drafted after what the commit replaced
            prompt_len = len(req.prompt_ids)
            req.output_ids = req.output_ids[: outcome.keep - prompt_len] + outcome.append
            if req.slot >= 0:
                self.engine.kv.shrink(req, outcome.keep)  # the disagreeing drafts' KV pages go back
        state.committed_len = outcome.committed_len
        state.limit_output(self.engine.context_length)
        self._resume(state)

    def _pace(self, lease: Lease, pace: pb.DraftPace) -> None:
        state = self.states.get(draft_key(lease.verifier_rank, pace.request_id))
        if state is None or state.lease_id != lease.lease_id:
            raise ProtocolViolation("DraftPace for a request that is not synced")
        if pace.ahead < 0:
            raise ProtocolViolation(f"DraftPace ahead {pace.ahead} < 0")
        state.ahead = min(pace.ahead, self.spec.max_draft_ahead)
        state.limit_output(self.engine.context_length)
        self._resume(state)

    def _close(self, key: str, reason: str | None) -> None:
        state = self.states.pop(key, None)
        if state is not None and state.admitted:
            self.engine.finish(state.req, FinishReason.ABORT, reason or "closed by the verifier")

    def _quarantine(self, lease: Lease, request_id: str, reason: str) -> None:
        logger.warning("quarantined request %s of verifier rank %d: %s", request_id, lease.verifier_rank, reason)
        self.quarantined_total += 1
        self._close(draft_key(lease.verifier_rank, request_id), f"quarantined: {reason}")
        self.outboxes.setdefault(lease.lease_id, Outbox()).quarantined.append(
            pb.Quarantined(request_id=request_id, reason=reason))

    def _resume(self, state: DraftState) -> None:
        req = state.req
        if (req.status is RequestStatus.PARKED and req.total_len - state.committed_len < state.ahead
                and req.total_len < self.engine.context_length):
            self.engine.scheduler.add_running(req)

    def _on_output(self, key: str, out: TokenOutput) -> None:
        """Only endings reach here (tokens are taken in on_token): an error is a quarantine."""
        state = self.states.get(key)
        if state is None or out.finish_reason is not FinishReason.ERROR:
            return
        lease = self.leases.get(state.lease_id)
        self.states.pop(key, None)
        if lease is not None:
            self._quarantine(lease, state.request_id, out.error or "the draft request failed")

    def on_arrival(self, req: Request) -> bool:
        state = self.states.get(req.request_id)
        if state is not None and state.req is req:
            state.admitted = True
            return False  # the scheduler runs it
        if req.request_id.startswith("draft:"):
            self.engine.finish(req, FinishReason.ABORT, "closed before it was admitted")
        else:
            self.engine.finish(req, FinishReason.ERROR, "a drafter serves the draft mesh, not completions")
        return True

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        state = self.states.get(req.request_id)
        if state is None:
            return False
        if state.stale:  # drafted from tokens a commit has replaced since: not a draft of anything
            state.stale -= 1
            self.stale_dropped += 1
            req.output_ids.pop()
            return True
        if state.held:  # a token the device computed at a position a commit has filled since
            if not state.streamed:
                # Committed, not a draft, but the verifier waits for drafts only of requests it has had a tail
                # of (DraftPolicy.primed). A drafter as fast as its verifier (the tiny model on an H200, with
                # the overlap scheduler) had every token of a fresh request overtaken by commits: it never drafted
                # one, and the verifier, never waiting, decoded all on its own. So the first such token goes back,
                # as what it is: the drafter's token after the committed ones before it (its base is its own
                # position). The verifier has committed past it (its buffer drops it), and now waits for drafts.
                position = req.total_len - 1
                self._stream(state, req.output_ids[-1], position, position)
            self._settle_held(state)
            return True
        self.drafted_total += 1
        self._stream(state, req.output_ids[-1], req.total_len - 1, state.committed_len)
        if finish is not None or req.total_len - state.committed_len >= state.ahead:
            self.engine.park(req)  # far enough ahead (or at the context's end): wait for a commit
        return True

    def _stream(self, state: DraftState, token: int, position: int, base: int) -> None:
        """Queues one tail token of the request for its verifier (flushed at the next poll), drafted from the
        first `base` tokens."""
        state.streamed = True
        self.outboxes.setdefault(state.lease_id, Outbox()).tokens.append(pb.TailToken(
            request_id=state.request_id, token=token, base_committed_len=base, position=position))

    def _settle_held(self, state: DraftState) -> None:
        """The request's newest token against the first held committed token. Equal: it stays, and the
        step queued after it (if any) computed the next position from the right token. Not equal: the
        committed tokens replace it, and the step queued after it is stale."""
        req, held = state.req, state.held
        next_on_device = req.pending_len == 0
        if req.output_ids[-1] == held[0]:
            self.held_kept += 1
            held.pop(0)
            if held and not next_on_device:  # nothing more on the device to compare: the rest is to run
                req.output_ids.extend(held)
                held.clear()
            return
        position = req.total_len - 1
        req.output_ids[-1:] = held
        held.clear()
        if next_on_device:
            state.stale += 1
            self.engine.kv.shrink(req, position)  # that step's input was the wrong token

    def on_finish(self, req: Request) -> None:
        state = self.states.get(req.request_id)
        if state is not None and state.req is req:
            del self.states[req.request_id]

    def on_preempted(self, req: Request) -> None:
        state = self.states.get(req.request_id)
        if state is not None and state.req is req:
            # The tokens it counted as stale were on the device; the engine drops them now (their step ran for
            # the request's last tenure). Its next token is the first of its computation again: a valid one.
            state.stale = 0

    def poll(self) -> None:
        if not self.service.running:  # the engine loop runs (its warm-up is done): verifiers may join
            self.service.running = True
            logger.info("drafter rank %d: engine running, taking verifiers", self.rank)
        for lease in self.leases.take_ended():
            self._end_lease(lease)
        for lease_id, box in list(self.outboxes.items()):
            if box.tokens or box.quarantined:
                self._send(lease_id, box)
        self.outboxes.clear()

    def _end_lease(self, lease: Lease) -> None:
        closed = [key for key, s in self.states.items() if s.lease_id == lease.lease_id]
        for key in closed:
            self._close(key, "the verifier's lease ended")
        sock = self.tail_sockets.pop(lease.lease_id, None)
        if sock is not None:
            sock.close(linger=0)
        self.outboxes.pop(lease.lease_id, None)
        logger.info("lease %s of verifier rank %d ended; closed %d requests", lease.lease_id, lease.verifier_rank,
                    len(closed))

    def _send(self, lease_id: str, box: Outbox) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        sock = self.tail_sockets.get(lease_id)
        if sock is None:
            sock = self.zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(lease.tail_endpoint)
            self.tail_sockets[lease_id] = sock
        batch = pb.TailBatch(lease_id=lease_id, tokens=box.tokens, quarantined=box.quarantined)
        try:
            sock.send_multipart(encode_frames(batch, self.key), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("verifier rank %d is not reading its tails; dropped %d", lease.verifier_rank,
                           len(box.tokens))
            for tail in box.tokens:  # the verifier may not know the drafter has these: the next overtaken token tells
                state = self.states.get(draft_key(lease.verifier_rank, tail.request_id))
                if state is not None:
                    state.streamed = False
