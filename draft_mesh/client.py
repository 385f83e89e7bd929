"""A verifier's link to one drafter: Join, then heartbeats, on its own thread; rejoins when lost.

The link never touches the engine: it reports `LinkEvent`s (joined with a lease, lost with the
reason) on a queue the verifier role drains on the loop thread. A heartbeat the drafter answers
with `known=False` (the lease expired, or the drafter restarted), or that fails outright (its port
refuses: the process is gone), loses the lease at once; heartbeats that only go unanswered within
the RPC timeout lose it once none was answered for `silent_after_s` (a drafter whose threads
stall for a moment, e.g. on a busy host's GIL, keeps its requests). The link then keeps trying to
join again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc

from splitserve.draft_mesh.auth import signed_metadata
from splitserve.draft_mesh.server import SERVICE
from splitserve.proto import draft_mesh_pb2 as pb
from splitserve.proto import draft_mesh_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Joins start at most this often (a refusal or an error the drafter answered is not retried at once).
REJOIN_BACKOFF_S = 0.5
# gRPC backs a failed channel's reconnects off exponentially (to minutes, by default) with +-20%
# jitter; a returning drafter must be found within about a second of its start, so the channel
# tries again at least every 0.6 s, and the Join waits on the channel (wait_for_ready), not on a poll.
MAX_RECONNECT_BACKOFF_MS = 500
RECONNECT_JITTER = 0.2
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS))


@dataclass(frozen=True)
class LinkEvent:
    """`joined` (with the drafter's reply) or `lost` (with why) for the link to `endpoint`."""

    endpoint: str
    kind: str
    reply: pb.JoinReply | None = None
    reason: str = ""


class MeshCaller:
    """Signed unary calls to one drafter's DraftMesh service."""

    def __init__(self, endpoint: str, key: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.key = key
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.DraftMeshStub(self.channel)

    def call(self, method: str, request, wait_for_ready: bool = False):
        """``wait_for_ready``: while the drafter is unreachable the call waits (up to the timeout) for
        the channel to connect and goes out the moment it does, instead of failing at once."""
        metadata = signed_metadata(self.key, SERVICE + method, request.SerializeToString())
        return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=metadata,
                                          wait_for_ready=wait_for_ready)

    def close(self) -> None:
        self.channel.close()


class DrafterLink:
    """Keeps one lease on one drafter alive while the verifier runs."""

    def __init__(self, endpoint: str, join: pb.JoinRequest, key: str, heartbeat_interval_s: float,
                 timeout_s: float, events: queue.Queue[LinkEvent], silent_after_s: float = 0.0) -> None:
        self.endpoint = endpoint
        self.join_request = join
        self.interval_s = heartbeat_interval_s
        self.silent_after_s = silent_after_s
        self._answered_at = 0.0  # when the drafter last answered a Join or Heartbeat
        self.events = events
        self.caller = MeshCaller(endpoint, key, timeout_s)
        self.lease: pb.JoinReply | None = None
        self.state = "joining"  # joining | joined | refused | unreachable
        self.last_reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"draft-link-{endpoint}", daemon=True)

    def start(self) -> DrafterLink:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.lease is None:
                started = time.monotonic()
                self._try_join()  # while the drafter is unreachable, this waits on the channel
                spent = time.monotonic() - started
                wait = self.interval_s if self.lease is not None else max(0.0, REJOIN_BACKOFF_S - spent)
            else:
                self._heartbeat()
                wait = self.interval_s if self.lease is not None else 0.0
            self._stop.wait(wait)

    def _try_join(self) -> None:
        try:
            reply = self.caller.call("Join", self.join_request, wait_for_ready=True)
        except grpc.RpcError as exc:
            waited = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            why = f"no answer within {self.caller.timeout_s:g}s" if waited else f"{exc.code().name}: {exc.details()}"
            self._set_state("unreachable", why)
            return
        if not reply.accepted:
            self._set_state("refused", f"{pb.Refusal.Name(reply.refusal)}: {reply.reason}")
            return
        self.lease = reply
        self._answered_at = time.monotonic()
        self._set_state("joined", f"lease {reply.lease_id} on drafter rank {reply.drafter_rank}")
        self.events.put(LinkEvent(self.endpoint, "joined", reply=reply))

    def _heartbeat(self) -> None:
        assert self.lease is not None
        try:
            known = self.caller.call("Heartbeat", pb.HeartbeatRequest(lease_id=self.lease.lease_id)).known
            why = "the drafter no longer knows the lease (expired or restarted)"
            self._answered_at = time.monotonic()
        except grpc.RpcError as exc:
            known, why = False, f"heartbeat failed: {exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                unanswered = time.monotonic() - self._answered_at
                if unanswered < self.silent_after_s:
                    logger.debug("drafter %s: a heartbeat went unanswered (%.2f s since the last answer)",
                                 self.endpoint, unanswered)
                    return  # slow, not yet silent
                why = f"silent: no heartbeat answered for {unanswered:.2f} s"
        if not known:
            self.lease = None
            self._set_state("unreachable", why)
            self.events.put(LinkEvent(self.endpoint, "lost", reason=why))

    def _set_state(self, state: str, reason: str) -> None:
        if (state, reason) != (self.state, self.last_reason):
            log = logger.info if state == "joined" else logger.warning
            log("drafter %s: %s (%s)", self.endpoint, state, reason)
        self.state, self.last_reason = state, reason

    def stop(self, leave: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if leave and self.lease is not None:
            with contextlib.suppress(grpc.RpcError):  # the drafter's lease then expires on its own
                self.caller.call("Leave", pb.LeaveRequest(lease_id=self.lease.lease_id))
        self.caller.close()
