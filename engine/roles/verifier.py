"""The verifier behaviour: use drafters' tokens to emit several tokens per decode step.

Added to the decode role (and to unified) when `--drafter` endpoints are given. It joins every
drafter (draft_mesh/client.py: a thread per drafter keeps the lease alive), spreads its decoding
requests over the drafters it holds a lease on (`DraftSync`, least loaded first), sends each
request's newly committed tokens after every step (`VerifyCommit`) and a `DraftClose` when it
ends. Drafted tokens stream back into a tail buffer per request (draft_mesh/tail_buffer.py);
before each step the buffer is checked against the committed tokens and up to K of its tokens
are offered to the scheduler as `Request.draft_tokens`, which verifies them in the step's one
forward (engine/scheduler.py, engine/runner/model_runner.py).

It waits for drafts at most `--draft-wait-ms` (default: not at all): a request with no tail then
decodes one token as usual. How many drafts a request is offered follows how many it had accepted
(draft_mesh/draft_policy.py): a request whose drafts keep failing decodes on its own for a while.
And the engine speculates only while that emits tokens faster than not speculating, as measured per
batch (draft_mesh/speculation_gate.py; --no-speculation-gate turns the gate off): while it does not,
no drafts are offered, no commits sent, drafters are paced to nothing and the overlap scheduler runs;
a request's next commit then carries every token since (K = 0 is that mode too). The gate also
bounds (--no-speculation-budget: it does not) what speculating loses against plain decoding's measured
rate (--speculation-margin, --speculation-budget-steps); its decisions, and what speculating saved
or lost, are on /health (`speculation_gate`) and in the splitserve_spec_gate_* metrics. A lost lease
or a silent drafter (a failed heartbeat, or none answered for --draft-silent-after-s) drops that
drafter's requests to plain decoding at once; they re-sync to another drafter, or to the same one
when it is joined again. Requests with repetition, frequency or presence penalties are not
speculated (their verification would not be exact), nor are requests a drafter quarantined. 16-bit
projections of up to --row-invariant-rows rows (default 32) run on a row-invariant kernel, plain
decode steps' too, so those verify steps' rows have plain decoding's bits (engine/layers/skinny.py);
--batch-invariant makes every step up to the largest verify step row-invariant and its attention
batch-invariant, so greedy output with drafts is plain decoding's in bfloat16 at every batch.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from splitserve.draft_mesh.client import DrafterLink, LinkEvent
from splitserve.draft_mesh.config import SpecConfig, default_verifier_rank, drafters_from_peers
from splitserve.draft_mesh.draft_policy import DraftPolicy
from splitserve.draft_mesh.fingerprint import model_fingerprint, tokenizer_fingerprint
from splitserve.draft_mesh.speculation_gate import PLAIN, SPECULATE, SpeculationGate
from splitserve.draft_mesh.tail_buffer import TailBuffer
from splitserve.draft_mesh.wire import WireError, decode_tails, encode_frames
from splitserve.engine.engine import Engine
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.role import Role
from splitserve.engine.runner.decode_graphs import DEFAULT_BUCKETS
from splitserve.engine.sampling_params import SamplingParams
from splitserve.proto import draft_mesh_pb2 as pb
from splitserve.transfer import TransferConfig

logger = logging.getLogger(__name__)

RECV_POLL_MS = 100
GATE_SUMMARY_EVERY = 16  # polls between copies of the gate's state for /health (and at every switch)
PEERS_REFRESH_S = 1.0  # how often the peers file is read again (drafters added or removed later)


def step_bucket(batch: int) -> int:
    """The decode batch's CUDA-graph bucket: steps in one bucket cost about the same."""
    return next((b for b in DEFAULT_BUCKETS if b >= batch), batch)


def tokens_emitted(counted: dict[str, int], now: dict[str, int]) -> int:
    """Tokens emitted since the output lengths `counted` were taken, by the output lengths `now` of the
    same requests (those still decoding, and those that finished since: a request's last step emits
    tokens too, and counting only the running ones charged a run's last step to the gate as all loss)."""
    return sum(now[rid] - n for rid, n in counted.items() if rid in now)


def speculation_exact_for(params: SamplingParams) -> bool:
    """Verification keeps the output distribution exactly unless the logits depend on the emitted
    tokens (penalties apply the committed state to every draft position)."""
    return params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0


@dataclass
class JoinedDrafter:
    """A drafter this verifier holds a lease on."""

    endpoint: str
    lease: pb.JoinReply
    socket: zmq.Socket
    requests: set[str] = field(default_factory=set)
    items: list[pb.DraftControl] = field(default_factory=list)


@dataclass
class SpecState:
    """One request's link to its drafter."""

    drafter: str  # endpoint
    lease_id: str
    sent_len: int  # committed tokens the drafter has been sent
    buffer: TailBuffer
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    step_k: int = 0  # drafts the policy allows this step
    offered: list[int] = field(default_factory=list)  # the drafts offered for the last step
    offered_at: int = 0  # the committed length they were offered at
    pace: int = -1  # the DraftPace last sent (-1: none; the drafter starts from the Join's K)


class VerifierRole(Role):
    """Draft-mesh client and tail buffers; the engine's verify step does the verifying."""

    name = "verifier"

    def __init__(self, spec: SpecConfig, transfer: TransferConfig) -> None:
        self.spec = spec
        self.num_draft_tokens = spec.num_draft_tokens  # K; benchmarks change it between runs
        self.rank = spec.verifier_rank if spec.verifier_rank is not None else default_verifier_rank(os.environ)
        self.key = transfer.transfer_control_key
        self.host = transfer.transfer_host
        self.instance = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.events: queue.Queue[LinkEvent] = queue.Queue()
        self.tails: deque[pb.TailBatch] = deque()
        self.drafters: dict[str, JoinedDrafter] = {}
        self.states: dict[str, SpecState] = {}
        self.quarantined: set[str] = set()
        self.dropped_messages = 0
        self._stop = threading.Event()
        self._tail_arrived = threading.Event()
        # Whether to speculate at all, from the token rates measured either way (draft_mesh/speculation_gate.py).
        self.gate = SpeculationGate(budgeted=spec.speculation_budget, margin=spec.speculation_margin,
                                    cap_steps=spec.speculation_budget_steps)
        self.speculating = True
        self.gate_summary: dict[str, Any] = {}
        self._gate_polls = 0
        self._last_poll: float | None = None
        self._counted: tuple[int, dict[str, int]] | None = None  # (batch bucket, output lengths) at the last poll
        self._finished: dict[str, int] = {}  # output lengths of the requests that finished since the last poll
        self._offered = False  # the last poll offered drafts (its step verified some)
        # What the benchmark reads: decoding steps per mode, steps that verified drafts, seconds waited.
        self.mode_steps = {SPECULATE: 0, PLAIN: 0}
        self.verify_steps = 0
        self.synced_total = 0  # requests handed to a drafter (DraftSync), ever: /health shows it
        self.waited_s = 0.0
        # Without --drafter the peers file lists the drafters; it is read again as drafters come and go.
        self.peers_file = "" if spec.drafter else spec.peers_file
        self._peers_read_at = 0.0
        self._peers_error = ""
        self.links: dict[str, DrafterLink] = {}

    # ---- setup and teardown ---------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        engine.prepare_speculation(self.spec.num_draft_tokens, self.spec.row_invariant_rows,
                                   self.spec.batch_invariant)
        self.metrics = engine.metrics
        self.zmq = zmq.Context()
        self.tail_socket = self.zmq.socket(zmq.PULL)
        self.tail_socket.setsockopt(zmq.LINGER, 0)
        self.tail_socket.bind_to_random_port(f"tcp://{self.host}")
        self.tail_endpoint = self.tail_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._receiver = threading.Thread(target=self._receive, name="draft-tail-recv", daemon=True)
        self._receiver.start()
        mc = engine.model_cfg
        self.join = pb.JoinRequest(
            verifier_rank=self.rank, verifier_instance=self.instance,
            model_fingerprint=model_fingerprint(mc.architecture, mc.num_layers, mc.hidden_size, mc.vocab_size,
                                                engine.cfg.model_name),
            tokenizer_fingerprint=tokenizer_fingerprint(engine.tokenizer), vocab_size=mc.vocab_size,
            draft_tokens=self.spec.num_draft_tokens, tail_endpoint=self.tail_endpoint)
        endpoints = list(self.spec.drafter) or self._read_peers() or []
        for endpoint in endpoints:
            self._add_link(endpoint)
        logger.info("verifier rank %d: tails on %s, drafters %s%s", self.rank, self.tail_endpoint,
                    ", ".join(endpoints) or "none yet", f" (watching {self.peers_file})" if self.peers_file else "")

    def _add_link(self, endpoint: str) -> None:
        self.links[endpoint] = DrafterLink(endpoint, self.join, self.key, self.spec.draft_heartbeat_interval_s,
                                           self.spec.draft_rpc_timeout_s, self.events,
                                           silent_after_s=self.spec.draft_silent_after_s).start()

    def _read_peers(self) -> list[str] | None:
        """The drafters the peers file lists now; None (logged once) while it cannot be read."""
        try:
            endpoints = drafters_from_peers(self.peers_file)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if str(exc) != self._peers_error:
                logger.warning("peers file %s unreadable (%s): keeping the drafters joined so far",
                               self.peers_file, exc)
            self._peers_error = str(exc)
            return None
        self._peers_error = ""
        return endpoints

    def _refresh_peers(self) -> None:
        """Joins drafters the peers file lists now and leaves those it no longer lists (once a second)."""
        now = time.monotonic()
        if not self.peers_file or now - self._peers_read_at < PEERS_REFRESH_S:
            return
        self._peers_read_at = now
        listed = self._read_peers()
        if listed is None:
            return
        for endpoint in listed:
            if endpoint not in self.links:
                logger.info("peers file: joining drafter %s", endpoint)
                self._add_link(endpoint)
        for endpoint in [ep for ep in self.links if ep not in listed]:
            logger.info("peers file: drafter %s is gone; leaving it", endpoint)
            link = self.links.pop(endpoint)
            self._drop_drafter(endpoint, "no longer in the peers file")
            # Leave off the loop thread: the link's thread and the Leave call take up to a second.
            threading.Thread(target=link.stop, name=f"draft-leave-{endpoint}", daemon=True).start()

    def close(self) -> None:
        for link in self.links.values():
            link.stop(leave=True)
        self._stop.set()
        self._receiver.join(timeout=2)
        for drafter in self.drafters.values():
            drafter.socket.close(linger=0)
        self.tail_socket.close(linger=0)
        self.zmq.term()

    def health_info(self) -> dict[str, Any]:
        return {"drafters": {ep: {"state": link.state, "detail": link.last_reason} for ep, link in self.links.items()},
                "joined_drafters": len(self.drafters), "speculating": len(self.states), "synced": self.synced_total,
                "quarantined": len(self.quarantined),
                "speculation_gate": self.gate_summary}

    def allows_overlap(self) -> bool:
        # Plain decoding keeps the overlap scheduler while no request has a drafter, or while the gate
        # keeps speculation off (a draft needs the token it follows on the host).
        return not self.states or not self.speculating

    # ---- the receive thread -----------------------------------------------------------------------

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.tail_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(RECV_POLL_MS):
                    continue
                frames = self.tail_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("draft tail socket failed")
                continue
            try:
                self.tails.append(decode_tails(frames, self.key))
                self._tail_arrived.set()
            except WireError as exc:
                self.dropped_messages += 1
                logger.warning("dropped a draft tail message: %s", exc)

    # ---- the loop thread --------------------------------------------------------------------------

    def poll(self) -> None:
        self._refresh_peers()
        self._gate()
        self._take_link_events()
        self._take_tails()
        short = [req for req in self.engine.requests.values() if self._step_request(req)]
        for drafter in list(self.drafters.values()):
            self._flush(drafter)
        if short and self.spec.draft_wait_ms > 0 and self.speculating:
            self._wait_for_drafts(short)
        self._offered = any(r.draft_tokens for r in self.engine.requests.values())
        self.verify_steps += self._offered

    def _gate(self) -> None:
        """Times the loop's last turn (one step) and picks whether this one speculates. It runs while a
        drafter is joined, whether or not a request is synced: in plain mode new requests are not
        synced (a drafter would prefill them for nothing) until the gate tries speculating."""
        finished, self._finished = self._finished, {}
        if not self.drafters:  # nothing can speculate: nothing to compare
            self._counted, self.speculating = None, True
            return
        now = time.monotonic()
        running = [r for r in self.engine.requests.values() if r.status is RequestStatus.RUNNING]
        if self._counted is not None and self._last_poll is not None:
            bucket, lengths = self._counted
            tokens = tokens_emitted(lengths, {**finished, **{r.request_id: len(r.output_ids) for r in running}})
            self.gate.observe(bucket, tokens, now - self._last_poll, verified=self._offered)
        self._last_poll = now
        # Only turns of decoding alone are timed: a prompt chunk in the step would cost it its time.
        decoding = all(r.output_ids and r.pending_len <= 1 for r in running) and bool(running)
        self._counted = ((step_bucket(len(running)), {r.request_id: len(r.output_ids) for r in running})
                         if decoding else None)
        if self.num_draft_tokens <= 0:
            self.gate.force(PLAIN)
        elif not self.spec.speculation_gate:
            self.gate.force(SPECULATE)
        elif decoding:
            self.gate.decide()
        self.speculating = self.gate.mode == SPECULATE
        if decoding:
            self.mode_steps[self.gate.mode] += 1
        self._publish_gate()

    def _publish_gate(self) -> None:
        """The gate's switches into metrics, its state into what /health reads (a copy: /health
        answers on another thread)."""
        switched = bool(self.gate.switched)
        for mode, why in self.gate.switched:
            self.metrics.spec_gate_switches.labels(self.metrics.model_name, mode, why).inc()
        self.gate.switched.clear()
        self.metrics.spec_gate_speculating.set(1 if self.speculating else 0)
        self._gate_polls += 1
        if switched or self._gate_polls % GATE_SUMMARY_EVERY == 1:
            self.metrics.spec_gate_saved_seconds.set(sum(b.saved_s for b in self.gate.budgets.values()))
            self.gate_summary = self.gate.summary()

    def _wait_for_drafts(self, short: list[Request]) -> None:
        """Waits (at most --draft-wait-ms) until the requests offered fewer than K drafts have them."""
        started = time.monotonic()
        deadline = started + self.spec.draft_wait_ms / 1000
        while short and (left := deadline - time.monotonic()) > 0:
            self._tail_arrived.wait(left)
            self._tail_arrived.clear()
            self._take_tails()
            short = [req for req in short if req.request_id in self.states
                     and self._offer(req, self.states[req.request_id])]
        self.waited_s += time.monotonic() - started

    def _take_link_events(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            if event.endpoint not in self.links:
                continue  # a link being stopped (its drafter left the peers file)
            if event.kind == "joined":
                self._drop_drafter(event.endpoint, "rejoined")
                self.gate.forget_speculation()
                sock = self.zmq.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(event.reply.control_endpoint)
                self.drafters[event.endpoint] = JoinedDrafter(event.endpoint, event.reply, sock)
            else:
                self._drop_drafter(event.endpoint, event.reason)

    def _drop_drafter(self, endpoint: str, why: str) -> None:
        """The drafter's requests fall back to plain decoding (and re-sync elsewhere, or later)."""
        drafter = self.drafters.pop(endpoint, None)
        if drafter is None:
            return
        self.gate.forget_speculation()
        for rid in drafter.requests:
            if self.states.pop(rid, None) is not None:
                self.metrics.spec_fallbacks.inc()
        drafter.socket.close(linger=0)
        if drafter.requests:
            logger.warning("drafter %s lost (%s): %d requests decode on their own", endpoint, why,
                           len(drafter.requests))

    def _take_tails(self) -> None:
        by_lease = {d.lease.lease_id: d for d in self.drafters.values()}
        while self.tails:
            batch = self.tails.popleft()
            drafter = by_lease.get(batch.lease_id)
            if drafter is None:
                continue  # from a lease that is gone: stale
            for tail in batch.tokens:
                state = self.states.get(tail.request_id)
                if state is not None and state.lease_id == batch.lease_id:
                    state.buffer.add(tail.token, tail.base_committed_len, tail.position)
                    state.policy.primed = True  # any tail, a stale one too: the drafter has taken the request in
            for q in batch.quarantined:
                state = self.states.get(q.request_id)
                if state is not None and state.lease_id == batch.lease_id:
                    logger.warning("drafter %s quarantined request %s: %s", drafter.endpoint, q.request_id, q.reason)
                    self.metrics.spec_quarantines.inc()
                    self.quarantined.add(q.request_id)
                    del self.states[q.request_id]
                    drafter.requests.discard(q.request_id)

    def _step_request(self, req: Request) -> bool:
        """Syncs or commits the request, offers its drafts; True if it was offered fewer than it could take."""
        if req.status is not RequestStatus.RUNNING or not req.output_ids:
            return False  # still in its prompt, or parked (its KV on the way)
        state = self.states.get(req.request_id)
        if state is None:
            if self.speculating and self.num_draft_tokens > 0:  # else the drafter need not hold it yet
                self._sync(req)
            return False
        drafter = self.drafters[state.drafter]
        if not self.speculating:  # the drafter rests; the next commit carries every token since
            req.draft_tokens, state.offered = [], []
            if state.pace != 0:
                drafter.items.append(pb.DraftControl(pace=pb.DraftPace(request_id=req.request_id, ahead=0)))
                state.pace = 0
            return False
        if req.total_len > state.sent_len:
            drafter.items.append(pb.DraftControl(commit=pb.VerifyCommit(
                request_id=req.request_id, pre_verify_committed_len=state.sent_len,
                tokens=req.output_ids[state.sent_len - len(req.prompt_ids):])))
            state.sent_len = req.total_len
        if state.offered and req.total_len > state.offered_at:  # how the last offer did
            start = state.offered_at - len(req.prompt_ids)
            emitted = req.output_ids[start:start + len(state.offered)]
            agree = [a == b for a, b in zip(state.offered, emitted, strict=False)]
            accepted = agree.index(False) if False in agree else len(agree)
            state.policy.observe(len(state.offered), accepted)
            state.offered = []
        if req.pending_len != 1:
            return False
        room = min(req.params.max_new_tokens - len(req.output_ids) - 1, self.engine.context_length - req.total_len)
        state.step_k = min(state.policy.draft_length(self.num_draft_tokens), room)
        ahead = min(state.policy.ahead(self.num_draft_tokens), max(room, 0))
        if ahead != state.pace:  # drafts the verifier will not take are compute the drafter can skip
            drafter.items.append(pb.DraftControl(pace=pb.DraftPace(request_id=req.request_id, ahead=ahead)))
            state.pace = ahead
        return self._offer(req, state)

    def _offer(self, req: Request, state: SpecState) -> bool:
        """Offers the request's drafts for the next step; True if fewer than it could take and
        worth waiting for."""
        state.buffer.reconcile(req.output_ids, offset=len(req.prompt_ids))
        req.draft_tokens = state.buffer.draft(req.total_len, state.step_k)
        state.offered, state.offered_at = list(req.draft_tokens), req.total_len
        return len(req.draft_tokens) < state.step_k and state.policy.worth_waiting

    def _sync(self, req: Request) -> None:
        if not self.drafters or req.request_id in self.quarantined or not speculation_exact_for(req.params):
            return
        drafter = min(self.drafters.values(), key=lambda d: len(d.requests))
        drafter.items.append(pb.DraftControl(sync=pb.DraftSync(
            request_id=req.request_id, prompt_ids=req.prompt_ids, output_ids=req.output_ids)))
        drafter.requests.add(req.request_id)
        self.synced_total += 1
        self.states[req.request_id] = SpecState(drafter.endpoint, drafter.lease.lease_id, req.total_len,
                                                TailBuffer(start=req.total_len, floor=req.total_len))

    def on_finish(self, req: Request) -> None:
        req.draft_tokens = []
        self._finished[req.request_id] = len(req.output_ids)  # the gate counts its last step's tokens
        state = self.states.pop(req.request_id, None)
        if state is None:
            return
        drafter = self.drafters.get(state.drafter)
        if drafter is not None:
            drafter.requests.discard(req.request_id)
            drafter.items.append(pb.DraftControl(close=pb.DraftClose(request_id=req.request_id)))

    def _flush(self, drafter: JoinedDrafter) -> None:
        if not drafter.items:
            return
        batch = pb.DraftControlBatch(lease_id=drafter.lease.lease_id, items=drafter.items)
        drafter.items = []
        try:
            drafter.socket.send_multipart(encode_frames(batch, self.key), zmq.NOBLOCK)
        except zmq.Again:
            # The drafter is not reading: what it holds is out of step now. Its requests decode on
            # their own and re-sync from scratch (a DraftSync replaces the drafter's copy).
            logger.warning("drafter %s is not reading its control messages; re-syncing its requests",
                           drafter.endpoint)
            for rid in drafter.requests:
                if self.states.pop(rid, None) is not None:
                    self.metrics.spec_fallbacks.inc()
            drafter.requests.clear()
