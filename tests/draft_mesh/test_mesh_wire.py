"""The draft mesh's pure parts: ZeroMQ frames, the drafter's commit rules, the verifier's tail buffer."""

from __future__ import annotations

import pytest

from splitserve.draft_mesh.commit_segments import ProtocolViolation, apply_commit
from splitserve.draft_mesh.config import SpecConfig
from splitserve.draft_mesh.draft_policy import DraftPolicy
from splitserve.draft_mesh.tail_buffer import TailBuffer
from splitserve.draft_mesh.wire import WireError, decode_control, decode_tails, encode_frames
from splitserve.proto import draft_mesh_pb2 as pb

KEY = "ab" * 16


def test_frames_round_trip_signed_and_refuse_tampering() -> None:
    batch = pb.DraftControlBatch(lease_id="l1", items=[
        pb.DraftControl(sync=pb.DraftSync(request_id="r", prompt_ids=[1, 2], output_ids=[3])),
        pb.DraftControl(commit=pb.VerifyCommit(request_id="r", pre_verify_committed_len=3, tokens=[4]))])
    frames = encode_frames(batch, KEY)
    assert decode_control(frames, KEY) == batch
    with pytest.raises(WireError, match="bad MAC"):
        decode_control(frames, "cd" * 16)
    with pytest.raises(WireError, match="bad MAC"):
        decode_control([frames[0], frames[1], frames[2][:-1] + b"\x05"], KEY)
    with pytest.raises(WireError, match="not a"):
        decode_tails([frames[0], b"", b"\xff\xff\xff"], "")
    with pytest.raises(WireError, match="3 frames"):
        decode_tails([b"garbage"], KEY)


def test_a_commit_that_agrees_keeps_the_drafts_beyond_it() -> None:
    out = apply_commit([1, 2, 3, 4, 5], committed_len=2, start=2, tokens=[3, 4], vocab_size=10)
    assert (out.keep, out.append, out.committed_len, out.truncated) == (5, [], 4, False)


def test_a_commit_that_disagrees_truncates_to_the_committed_prefix() -> None:
    out = apply_commit([1, 2, 3, 4, 5], committed_len=2, start=2, tokens=[3, 9, 7], vocab_size=10)
    assert (out.keep, out.append, out.committed_len) == (3, [9, 7], 5)
    beyond = apply_commit([1, 2], committed_len=2, start=2, tokens=[6], vocab_size=10)
    assert (beyond.keep, beyond.append) == (2, [6])


@pytest.mark.parametrize(("start", "tokens", "words"), [
    (3, [1], "gap"), (1, [1], "overlap"), (2, [], "empty"), (2, [10], "outside"), (2, [-1], "outside")])
def test_gaps_overlaps_and_malformed_commits_are_violations(start, tokens, words) -> None:
    with pytest.raises(ProtocolViolation, match=words):
        apply_commit([1, 2, 3], committed_len=2, start=start, tokens=tokens, vocab_size=10)


def test_the_tail_buffer_offers_drafts_past_the_committed_length() -> None:
    buf = TailBuffer()
    for pos, tok in zip(range(3, 7), [30, 40, 50, 60], strict=True):
        assert buf.add(tok, base_committed_len=3, position=pos)
    committed = [0, 1, 2]
    assert buf.reconcile(committed) and buf.draft(3, k=2) == [30, 40]
    committed += [30, 40]  # the verifier accepted two, plus its own token at 5
    committed += [51]
    assert not buf.reconcile(committed)  # 50 != 51: the chain is wrong from there on
    assert buf.draft(6, k=4) == [] and buf.floor == 6
    assert not buf.add(70, base_committed_len=3, position=6)  # drafted before the drafter saw the fix
    assert buf.stale_dropped == 1
    assert buf.add(71, base_committed_len=6, position=6) and buf.add(72, base_committed_len=6, position=7)
    assert buf.reconcile(committed) and buf.draft(6, k=4) == [71, 72]


def test_a_redrafted_position_replaces_the_chain_from_there() -> None:
    buf = TailBuffer()
    for pos, tok in enumerate([5, 6, 7], start=2):
        buf.add(tok, 2, pos)
    buf.add(8, 3, 3)  # the drafter re-drafted position 3 after a commit at 2..3
    assert (buf.start, buf.chain) == (2, [5, 8])
    buf.add(9, 9, 9)  # a gap: the chain restarts there
    assert (buf.start, buf.chain) == (9, [9])
    assert buf.reconcile([0] * 5) and buf.draft(5, 3) == []  # not contiguous with the committed tokens


def test_the_tail_buffer_reads_committed_tokens_past_an_offset() -> None:
    buf = TailBuffer()
    buf.add(7, 4, 4)
    buf.add(8, 4, 5)
    assert buf.reconcile([7], offset=4) and buf.draft(5, 2) == [8]
    assert not buf.reconcile([7, 9], offset=4) and buf.floor == 6


def test_a_request_whose_drafts_are_rejected_pauses_then_probes_and_recovers() -> None:
    policy = DraftPolicy(primed=True)  # the drafter has drafted for it before
    assert policy.draft_length(4) == 4 and policy.worth_waiting
    for _ in range(5):
        policy.observe(4, 1)  # a quarter accepted: fewer drafts
    assert 1 <= policy.draft_length(4) < 4 and not policy.worth_waiting
    while policy.acceptance >= 0.15:
        policy.observe(4, 0)
    lengths = [policy.draft_length(4) for _ in range(5)]
    assert lengths[:4] == [0, 0, 0, 0] and lengths[4] >= 1  # paused 4 steps, then a probe
    policy.observe(lengths[4], 0)
    lengths = [policy.draft_length(4) for _ in range(9)]
    assert lengths[:8] == [0] * 8 and lengths[8] >= 1  # the next pause is twice as long
    for _ in range(6):
        offered = max(policy.draft_length(4), 1)
        policy.observe(offered, offered)
    assert policy.draft_length(4) == 4 and policy.backoff == 4  # agreeing again: all K, backoff reset


def test_drafts_are_waited_for_only_once_the_drafter_has_drafted_for_the_request() -> None:
    # A probe of speculation syncs a whole batch at once; while the drafter takes the requests in
    # (it prefills them), their first drafts are not milliseconds away: no step waits for them.
    policy = DraftPolicy()
    assert policy.draft_length(4) == 4 and not policy.worth_waiting
    policy.primed = True  # its first drafts arrived
    assert policy.worth_waiting


def test_the_verifier_waits_for_a_requests_drafts_once_its_first_have_come() -> None:
    from splitserve.engine.request import Request
    from splitserve.engine.roles.verifier import JoinedDrafter, SpecState, VerifierRole
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer import TransferConfig

    role = VerifierRole(SpecConfig(draft_wait_ms=4.0), TransferConfig(transfer_control_key="ab" * 16))
    role.drafters["127.0.0.1:1"] = JoinedDrafter("127.0.0.1:1", pb.JoinReply(lease_id="lease-1"), socket=None)
    req = Request("r", [1, 2, 3], SamplingParams(max_new_tokens=16, temperature=0.0), on_output=lambda _out: None)
    req.output_ids = [5]  # committed: 4 tokens
    state = SpecState("127.0.0.1:1", "lease-1", 4, TailBuffer(start=4, floor=4), step_k=4)
    role.states["r"] = state
    assert not role._offer(req, state) and req.draft_tokens == []  # synced, nothing drafted: no wait
    role.tails.append(pb.TailBatch(lease_id="lease-1", tokens=[
        pb.TailToken(request_id="r", token=9, base_committed_len=4, position=4)]))
    role._take_tails()
    assert role._offer(req, state) and req.draft_tokens == [9]  # 1 of 4 so far: the rest is worth a wait
    role.tails.append(pb.TailBatch(lease_id="lease-1", tokens=[
        pb.TailToken(request_id="r", token=t, base_committed_len=4, position=5 + i) for i, t in enumerate((8, 7, 6))]))
    role._take_tails()
    assert not role._offer(req, state) and req.draft_tokens == [9, 8, 7, 6]  # all 4: nothing to wait for


def test_the_drafter_is_asked_to_draft_less_far_ahead_as_acceptance_falls() -> None:
    policy = DraftPolicy()
    assert policy.ahead(4) == 9 and policy.ahead(0) == 0  # the next step's 4 drafts after 5 committed
    for _ in range(5):
        policy.observe(4, 1)
    assert 3 <= policy.ahead(4) < 9
    while policy.acceptance >= 0.15:
        policy.observe(4, 0)
    assert policy.ahead(4) == 0
