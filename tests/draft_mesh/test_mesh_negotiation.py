"""DraftMesh over real gRPC on loopback: Join checks and leases, heartbeats, Leave, authentication."""

from __future__ import annotations

import contextlib
import queue
import time

import grpc
import pytest

from splitserve.draft_mesh.auth import call_refusal, signed_metadata
from splitserve.draft_mesh.client import (
    MAX_RECONNECT_BACKOFF_MS,
    RECONNECT_JITTER,
    DrafterLink,
    LinkEvent,
    MeshCaller,
)
from splitserve.draft_mesh.leases import LeaseTable
from splitserve.draft_mesh.server import DrafterIdentity, DraftMeshService, start_mesh_server
from splitserve.proto import draft_mesh_pb2 as pb

KEY = "ab" * 16
IDENTITY = DrafterIdentity(rank=3, instance="drafter-a", tokenizer_fingerprint="tok-1", vocab_size=320,
                           control_endpoint="tcp://127.0.0.1:5999", max_draft_ahead=6)


def join_request(**changes) -> pb.JoinRequest:
    fields = {"verifier_rank": 0, "verifier_instance": "v0", "model_fingerprint": "m", "tokenizer_fingerprint": "tok-1",
              "vocab_size": 320, "draft_tokens": 4, "tail_endpoint": "tcp://127.0.0.1:6000"}
    fields.update(changes)
    return pb.JoinRequest(**fields)


@pytest.fixture
def mesh():
    leases = LeaseTable(ttl_s=0.6, max_leases=2)
    service = DraftMeshService(IDENTITY, leases, KEY)
    server, port = start_mesh_server(service, "127.0.0.1", 0)
    caller = MeshCaller(f"127.0.0.1:{port}", KEY, timeout_s=2.0)
    yield service, leases, caller, port
    caller.close()
    server.stop(0)


def test_join_grants_a_lease_with_the_drafters_rank_and_endpoints(mesh) -> None:
    _, leases, caller, _ = mesh
    reply = caller.call("Join", join_request())
    assert reply.accepted and reply.drafter_rank == 3 and reply.control_endpoint == IDENTITY.control_endpoint
    assert reply.max_draft_ahead == 6 and reply.lease_ttl_s == pytest.approx(0.6)
    assert leases.get(reply.lease_id).tail_endpoint == "tcp://127.0.0.1:6000"
    assert caller.call("Heartbeat", pb.HeartbeatRequest(lease_id=reply.lease_id)).known
    assert caller.call("Leave", pb.LeaveRequest(lease_id=reply.lease_id)).known
    assert not caller.call("Heartbeat", pb.HeartbeatRequest(lease_id=reply.lease_id)).known
    assert [lease.lease_id for lease in leases.take_ended()] == [reply.lease_id]


@pytest.mark.parametrize(("changes", "refusal", "words"), [
    ({"tokenizer_fingerprint": "tok-2"}, pb.REFUSAL_TOKENIZER_MISMATCH, "tokenizer mismatch"),
    ({"vocab_size": 321}, pb.REFUSAL_VOCAB_MISMATCH, "321"),
    ({"draft_tokens": 0}, pb.REFUSAL_BAD_REQUEST, "draft_tokens"),
])
def test_join_is_refused_with_the_reason(mesh, changes, refusal, words) -> None:
    _, leases, caller, _ = mesh
    reply = caller.call("Join", join_request(**changes))
    assert not reply.accepted and reply.refusal == refusal and words in reply.reason
    assert len(leases) == 0


def test_join_is_refused_when_full_or_draining(mesh) -> None:
    service, _, caller, _ = mesh
    assert caller.call("Join", join_request(verifier_rank=0)).accepted
    assert caller.call("Join", join_request(verifier_rank=1)).accepted
    full = caller.call("Join", join_request(verifier_rank=2))
    assert not full.accepted and full.refusal == pb.REFUSAL_FULL
    service.draining = True
    assert caller.call("Join", join_request(verifier_rank=5)).refusal == pb.REFUSAL_DRAINING


def test_a_drafter_warming_up_refuses_joins_and_a_link_joins_once_it_runs(mesh) -> None:
    # A drafter whose engine still compiles would take requests no draft comes for (on a GPU for
    # seconds, while its warm-up holds the device): verifiers join once it runs.
    service, leases, caller, port = mesh
    service.running = False
    reply = caller.call("Join", join_request())
    assert not reply.accepted and reply.refusal == pb.REFUSAL_WARMING_UP and "warming up" in reply.reason
    assert len(leases) == 0
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = DrafterLink(f"127.0.0.1:{port}", join_request(), KEY, heartbeat_interval_s=0.1, timeout_s=1.0,
                       events=events).start()
    try:
        deadline = time.monotonic() + 5
        while link.state != "refused":  # its first Join, answered
            assert time.monotonic() < deadline, link.state
            time.sleep(0.02)
        time.sleep(0.6)  # a while longer (it joins again every REJOIN_BACKOFF_S): still refused, none joined
        assert events.empty() and link.state == "refused" and "WARMING_UP" in link.last_reason
        service.running = True
        joined = events.get(timeout=5)
        assert joined.kind == "joined" and leases.get(joined.reply.lease_id) is not None
    finally:
        link.stop()
    assert len(leases) == 0


def test_a_rejoining_verifier_replaces_its_old_lease(mesh) -> None:
    _, leases, caller, _ = mesh
    first = caller.call("Join", join_request(verifier_instance="v0"))
    second = caller.call("Join", join_request(verifier_instance="v0"))
    assert first.lease_id != second.lease_id and len(leases) == 1
    assert [lease.lease_id for lease in leases.take_ended()] == [first.lease_id]


def test_another_verifier_with_a_live_rank_is_refused_until_the_lease_expires(mesh) -> None:
    caller = mesh[2]
    assert caller.call("Join", join_request(verifier_instance="old")).accepted
    clash = caller.call("Join", join_request(verifier_instance="new"))
    assert not clash.accepted and clash.refusal == pb.REFUSAL_BAD_REQUEST
    assert "held by the live verifier old" in clash.reason
    time.sleep(0.8)  # the old one stopped heartbeating: its lease expires
    assert caller.call("Join", join_request(verifier_instance="new")).accepted


def test_a_lease_without_heartbeats_expires(mesh) -> None:
    _, leases, caller, _ = mesh
    reply = caller.call("Join", join_request())
    time.sleep(0.8)
    assert not caller.call("Heartbeat", pb.HeartbeatRequest(lease_id=reply.lease_id)).known
    assert [lease.lease_id for lease in leases.take_ended()] == [reply.lease_id]


def test_calls_without_the_groups_key_are_refused(mesh) -> None:
    _, leases, _, port = mesh
    for key in ("", "cd" * 16):
        wrong = MeshCaller(f"127.0.0.1:{port}", key, timeout_s=2.0)
        with pytest.raises(grpc.RpcError) as err:
            wrong.call("Join", join_request())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong.close()
    assert len(leases) == 0


def test_a_signed_call_cannot_be_replayed_for_another_body_or_later() -> None:
    meta = signed_metadata(KEY, "/s/Join", b"body", now=1000.0)
    assert call_refusal(KEY, "/s/Join", b"body", meta, now=1000.5) is None
    assert "bad MAC" in call_refusal(KEY, "/s/Join", b"other", meta, now=1000.5)
    assert "bad MAC" in call_refusal(KEY, "/s/Leave", b"body", meta, now=1000.5)
    assert "off this drafter's clock" in call_refusal(KEY, "/s/Join", b"body", meta, now=2000.0)


def test_a_link_joins_heartbeats_and_reports_a_lost_lease(mesh) -> None:
    _, leases, _, port = mesh
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = DrafterLink(f"127.0.0.1:{port}", join_request(), KEY, heartbeat_interval_s=0.1, timeout_s=1.0,
                       events=events).start()
    try:
        joined = events.get(timeout=5)
        assert joined.kind == "joined" and joined.reply.drafter_rank == 3
        time.sleep(1.0)  # longer than the ttl: heartbeats keep it
        assert leases.get(joined.reply.lease_id) is not None
        leases.leave(joined.reply.lease_id)
        lost = events.get(timeout=5)
        assert lost.kind == "lost" and "no longer knows" in lost.reason
        rejoined = events.get(timeout=5)
        assert rejoined.kind == "joined" and rejoined.reply.lease_id != joined.reply.lease_id
    finally:
        link.stop()
    assert len(leases) == 0  # stop() left


class StallingMeshService(DraftMeshService):
    """The real service, whose heartbeats take `stall_s` to answer (a drafter whose threads wait on a busy
    host) while `stalls` is positive, once each."""

    stall_s = 0.0
    stalls = 0

    def Heartbeat(self, request, context):
        if self.stalls > 0:
            self.stalls -= 1
            time.sleep(self.stall_s)
        return super().Heartbeat(request, context)


@contextlib.contextmanager
def link_to_a_stalling_drafter(**link_options):
    """A DrafterLink joined to a StallingMeshService on loopback: (service, link, events, the joined event)."""
    service = StallingMeshService(IDENTITY, LeaseTable(ttl_s=5.0, max_leases=2), KEY)
    server, port = start_mesh_server(service, "127.0.0.1", 0)
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = DrafterLink(f"127.0.0.1:{port}", join_request(), KEY, heartbeat_interval_s=0.05, timeout_s=0.2,
                       events=events, **link_options).start()
    try:
        joined = events.get(timeout=5)
        assert joined.kind == "joined"
        yield service, link, events, joined
    finally:
        service.stalls = 0
        link.stop()
        server.stop(0)


def test_a_heartbeat_unanswered_for_a_moment_keeps_the_lease_and_a_silent_drafter_loses_it() -> None:
    with link_to_a_stalling_drafter(silent_after_s=0.6) as (service, link, events, joined):
        service.stall_s, service.stalls = 0.3, 1  # one heartbeat past the RPC timeout, then answers again
        with pytest.raises(queue.Empty):
            events.get(timeout=1.0)
        assert service.stalls == 0 and link.state == "joined" and link.lease.lease_id == joined.reply.lease_id
        service.stall_s, service.stalls = 0.3, 10**6  # no heartbeat answered in time from now on
        stalled = time.monotonic()
        lost = events.get(timeout=5)
        assert lost.kind == "lost" and "silent: no heartbeat answered for" in lost.reason
        # silent_after_s and one call's timeout, with room for a loaded machine: within 2 s
        assert 0.5 < time.monotonic() - stalled < 2.0


def test_a_link_to_a_drafter_that_stalls_drops_it_on_the_first_unanswered_heartbeat_by_default() -> None:
    with link_to_a_stalling_drafter() as (service, _, events, _):
        service.stall_s, service.stalls = 0.3, 1
        lost = events.get(timeout=5)
        assert lost.kind == "lost" and "silent: no heartbeat answered for" in lost.reason


def test_a_link_finds_a_drafter_that_comes_back_on_its_port_within_a_second() -> None:
    leases = LeaseTable(ttl_s=2.0, max_leases=2)
    server, port = start_mesh_server(DraftMeshService(IDENTITY, leases, KEY), "127.0.0.1", 0)
    events: queue.Queue[LinkEvent] = queue.Queue()
    link = DrafterLink(f"127.0.0.1:{port}", join_request(), KEY, heartbeat_interval_s=0.1, timeout_s=1.0,
                       events=events).start()
    try:
        assert events.get(timeout=5).kind == "joined"
        server.stop(0)
        assert events.get(timeout=5).kind == "lost"
        time.sleep(8.0)  # long enough for gRPC's default reconnect backoff to grow past several seconds
        leases = LeaseTable(ttl_s=2.0, max_leases=2)
        server, _ = start_mesh_server(DraftMeshService(IDENTITY, leases, KEY), "127.0.0.1", port)
        back = time.monotonic()
        assert events.get(timeout=5).kind == "joined"
        # The channel tries again within its capped, jittered backoff (0.6 s) of the drafter's start and the
        # waiting Join goes out the moment it connects (no poll): that, plus the Join's round trip under load.
        next_attempt_s = MAX_RECONNECT_BACKOFF_MS / 1000 * (1 + RECONNECT_JITTER)
        assert time.monotonic() - back < next_attempt_s + 0.4
    finally:
        link.stop()
        server.stop(0)
