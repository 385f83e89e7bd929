"""A drafter's DraftMesh gRPC service: Join (checks, then a lease), Heartbeat, Leave.

Every call is authenticated with the group's key (draft_mesh/auth.py); Join refuses a verifier
whose tokenizer or vocabulary differs, when the lease table is full, while draining, or while the
drafter's engine warms up (a verifier's link joins again every draft_mesh/client.py REJOIN_BACKOFF_S).
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc

from splitserve.draft_mesh.auth import call_refusal
from splitserve.draft_mesh.leases import LeaseTable, RankHeld
from splitserve.proto import draft_mesh_pb2 as pb
from splitserve.proto import draft_mesh_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE = "/splitserve.draft_mesh.v1.DraftMesh/"


@dataclass(frozen=True)
class DrafterIdentity:
    """What Join compares and answers with."""

    rank: int
    instance: str
    tokenizer_fingerprint: str
    vocab_size: int
    control_endpoint: str
    max_draft_ahead: int


class DraftMeshService(pb_grpc.DraftMeshServicer):
    """The servicer; the lease table is shared with the drafter role."""

    def __init__(self, identity: DrafterIdentity, leases: LeaseTable, key: str, running: bool = True) -> None:
        self.identity = identity
        self.leases = leases
        self.key = key
        self.draining = False
        # False while the drafter's engine warms up (compiles, captures graphs: seconds on a GPU, where it
        # also holds the device): a verifier joined then would sync requests no draft comes for, and its
        # gate would measure speculating as a loss.
        self.running = running

    def _authenticate(self, method: str, request, context: grpc.ServicerContext) -> None:
        refusal = call_refusal(self.key, SERVICE + method, request.SerializeToString(),
                               context.invocation_metadata())
        if refusal is not None:
            logger.warning("draft mesh %s from %s refused: %s", method, context.peer(), refusal)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self._authenticate("Join", request, context)
        me = self.identity
        refusal, reason = pb.REFUSAL_NONE, ""
        if request.tokenizer_fingerprint != me.tokenizer_fingerprint:
            refusal = pb.REFUSAL_TOKENIZER_MISMATCH
            reason = (f"tokenizer mismatch: the verifier's fingerprint is {request.tokenizer_fingerprint[:16]}, "
                      f"this drafter's {me.tokenizer_fingerprint[:16]}")
        elif request.vocab_size != me.vocab_size:
            refusal = pb.REFUSAL_VOCAB_MISMATCH
            reason = f"vocabulary mismatch: the verifier has {request.vocab_size} tokens, this drafter {me.vocab_size}"
        elif request.draft_tokens < 1 or not request.tail_endpoint:
            refusal, reason = pb.REFUSAL_BAD_REQUEST, "draft_tokens must be >= 1 and tail_endpoint set"
        elif self.draining:
            refusal, reason = pb.REFUSAL_DRAINING, "this drafter is draining"
        elif not self.running:
            refusal, reason = pb.REFUSAL_WARMING_UP, "warming up: this drafter's engine is not running yet"
        if refusal != pb.REFUSAL_NONE:
            logger.log(logging.INFO if refusal == pb.REFUSAL_WARMING_UP else logging.WARNING,
                       "refused Join of verifier rank %d: %s", request.verifier_rank, reason)
            return pb.JoinReply(accepted=False, refusal=refusal, reason=reason, drafter_rank=me.rank,
                                drafter_instance=me.instance)
        try:
            lease = self.leases.grant(request.verifier_rank, request.verifier_instance, request.tail_endpoint,
                                      request.draft_tokens)
        except RankHeld as exc:
            return pb.JoinReply(accepted=False, refusal=pb.REFUSAL_BAD_REQUEST, reason=str(exc), drafter_rank=me.rank,
                                drafter_instance=me.instance)
        if lease is None:
            return pb.JoinReply(accepted=False, refusal=pb.REFUSAL_FULL, drafter_rank=me.rank,
                                drafter_instance=me.instance,
                                reason=f"full: this drafter holds {self.leases.max_leases} leases")
        logger.info("verifier rank %d (%s, model %s) joined: lease %s, tails to %s", request.verifier_rank,
                    request.verifier_instance, request.model_fingerprint, lease.lease_id, request.tail_endpoint)
        return pb.JoinReply(accepted=True, drafter_rank=me.rank, drafter_instance=me.instance,
                            control_endpoint=me.control_endpoint, lease_id=lease.lease_id,
                            lease_ttl_s=self.leases.ttl_s, max_draft_ahead=me.max_draft_ahead)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        self._authenticate("Heartbeat", request, context)
        return pb.HeartbeatReply(known=self.leases.heartbeat(request.lease_id), drafter_instance=self.identity.instance)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self._authenticate("Leave", request, context)
        return pb.LeaveReply(known=self.leases.leave(request.lease_id))


def start_mesh_server(service: DraftMeshService, host: str, port: int) -> tuple[grpc.Server, int]:
    """Serves `service` on host:port (0: any free port); returns the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="draft-mesh"))
    pb_grpc.add_DraftMeshServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the draft mesh gRPC port {host}:{port}")
    server.start()
    return server, bound
