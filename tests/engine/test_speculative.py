"""Speculative decoding through the draft mesh, with real gRPC and ZeroMQ on loopback: drafter and
verifier engines in this process, each with its own sockets, as separate pods would have them."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import zmq
from scipy.stats import chi2_contingency
from servers import free_port

from splitserve.draft_mesh import SpecConfig
from splitserve.draft_mesh.client import MeshCaller
from splitserve.draft_mesh.fingerprint import tokenizer_fingerprint
from splitserve.draft_mesh.speculation_gate import PLAIN, SPECULATE
from splitserve.draft_mesh.tail_buffer import TailBuffer
from splitserve.draft_mesh.wire import decode_tails, encode_frames
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.role import ComposedRole
from splitserve.engine.roles import drafter as drafter_module
from splitserve.engine.roles.drafter import DrafterRole, DraftState, drafter_engine_config
from splitserve.engine.roles.verifier import VerifierRole
from splitserve.engine.sampling_params import SamplingParams
from splitserve.proto import draft_mesh_pb2 as pb
from splitserve.transfer import TransferConfig

KEY = "5a" * 16
TRANSFER = TransferConfig(transfer_control_key=KEY)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43, 44, 45], [100, 7, 100]]
GREEDY = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
ENGINE = {"device": "cpu", "page_size": 4, "max_total_tokens": 2048, "max_running_requests": 8}
WAIT_MS = 40.0  # the tiny drafter is no faster than the tiny target: let it get ahead


def start_drafter(model: str = "tiny", seed: int = 0, port: int | None = None, overlap: bool = False) -> Engine:
    """`overlap`: the overlap scheduler as on a GPU (each step queued before the last one's token is
    taken in; on the CPU a step is computed at once, so only the bookkeeping differs, which is
    what it tests: tokens that a commit made stale while their step was in flight)."""
    spec = SpecConfig(draft_mesh_port=port or free_port(), max_draft_ahead=8)
    engine = Engine(drafter_engine_config(EngineConfig(model=model, seed=seed, **ENGINE)),
                    role=ComposedRole("drafter", [DrafterRole(spec, TRANSFER)]))
    engine.overlap = overlap or engine.overlap
    engine.start()
    return engine


def test_a_drafter_engine_builds_no_grammar_compiler_and_a_unified_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.engine.grammar.compiler import GrammarCompiler

    warmed: list[GrammarCompiler] = []
    real = GrammarCompiler.warm_up_in_background
    monkeypatch.setattr(GrammarCompiler, "warm_up_in_background", lambda self: warmed.append(self) or real(self))
    drafter = start_drafter()
    try:
        assert warmed == []
    finally:
        drafter.stop()
    unified = Engine(EngineConfig(model="tiny", **ENGINE))
    unified.start()
    try:
        assert warmed == [unified.grammar]
        if importlib.util.find_spec("xgrammar") is not None:  # built before start() returned: /health waits for it
            assert unified.grammar._compiler is not None
    finally:
        unified.stop()


def mesh_endpoint(drafter: Engine) -> str:
    return f"127.0.0.1:{drafter.role.health_info()['draft_mesh_port']}"


def start_verifier(drafters: list[Engine], k: int = 4, rank: int = 0, wait_ms: float = WAIT_MS,
                   gate: bool = False, budget: bool = False) -> Engine:
    # Without the gate every draft offered is verified: the tests count them.
    spec = SpecConfig(drafter=[mesh_endpoint(d) for d in drafters], num_draft_tokens=k, verifier_rank=rank,
                      draft_wait_ms=wait_ms, speculation_gate=gate, speculation_budget=budget)
    engine = Engine(EngineConfig(model="tiny", **ENGINE), role=ComposedRole("unified", [VerifierRole(spec, TRANSFER)]))
    engine.start()
    return engine


def wait_joined(verifier: Engine, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [d["state"] for d in verifier.role.health_info()["drafters"].values()]
        if states.count("joined") >= count:
            time.sleep(0.1)  # the loop takes the join event on its next poll
            return
        time.sleep(0.02)
    raise TimeoutError(f"verifier joined {states}")


def assert_idle_and_pages_back(*engines: Engine, timeout: float = 10.0) -> None:
    for engine in engines:
        deadline = time.monotonic() + timeout
        while True:
            s = engine.state()
            kv = s.kv
            if (not engine.requests and s.running == s.waiting == s.parked == 0 and kv.locked == 0
                    and kv.slots_in_use == 0 and kv.free + kv.cached == kv.capacity):
                break
            assert time.monotonic() < deadline, f"{engine.role.name}: not back to start: {s}"
            time.sleep(0.05)


def spec_counts(verifier: Engine) -> tuple[float, float]:
    m = verifier.metrics
    return m.spec_draft_tokens._value.get(), m.spec_accepted_tokens._value.get()


@contextlib.contextmanager
def joined_by_hand(drafter: Engine, verifier_rank: int, draft_tokens: int
                   ) -> Iterator[tuple[MeshCaller, pb.JoinReply, zmq.Socket, zmq.Socket]]:
    """A lease on `drafter` joined by the test itself, as a verifier would: (its mesh caller, the lease,
    the PUSH socket of the lease's control channel, the PULL socket its drafted tokens come to)."""
    ctx = zmq.Context()
    tails = ctx.socket(zmq.PULL)
    tail_port = tails.bind_to_random_port("tcp://127.0.0.1")
    caller = MeshCaller(mesh_endpoint(drafter), KEY, timeout_s=5)
    try:
        lease = caller.call("Join", pb.JoinRequest(
            verifier_rank=verifier_rank, verifier_instance="test",
            tokenizer_fingerprint=tokenizer_fingerprint(drafter.tokenizer), vocab_size=drafter.model_cfg.vocab_size,
            draft_tokens=draft_tokens, tail_endpoint=f"tcp://127.0.0.1:{tail_port}"))
        assert lease.accepted
        control = ctx.socket(zmq.PUSH)
        control.connect(lease.control_endpoint)
        yield caller, lease, control, tails
    finally:
        caller.close()
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    engine = Engine(EngineConfig(model="tiny", **ENGINE))
    engine.start()
    try:
        return generate_tokens(engine, PROMPTS, GREEDY)
    finally:
        engine.stop()


@pytest.fixture
def stopper() -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    yield engines
    for engine in reversed(engines):
        engine.stop()


def test_the_drafters_overlap_scheduler_is_on_by_default_and_the_engines_disable_overlap_wins() -> None:
    """On by default (1.21-2.32x of plain at batch 1 on an H200, 0.91-1.06x without it)."""
    base = EngineConfig(model="tiny")
    assert SpecConfig().drafter_overlap is True
    assert drafter_engine_config(base).disable_overlap is False
    assert drafter_engine_config(base, overlap=False).disable_overlap is True
    assert drafter_engine_config(EngineConfig(model="tiny", disable_overlap=True), overlap=True).disable_overlap
    assert drafter_engine_config(base, overlap=True).disable_prefix_cache is False  # the drafter's prefix cache
    assert SpecConfig().drafter_prefix_cache is True
    assert drafter_engine_config(base, prefix_cache=False).disable_prefix_cache is True
    assert drafter_engine_config(EngineConfig(model="tiny", disable_prefix_cache=True)).disable_prefix_cache


@pytest.mark.parametrize(("k", "overlap"), [(2, False), (5, False), (2, True), (5, True)])
def test_a_drafter_equal_to_the_target_has_nearly_every_draft_accepted(plain, stopper, k, overlap,
                                                                       monkeypatch) -> None:
    if overlap:  # a verifier slower than its drafter, as on a GPU (see the next test but one)
        poll = VerifierRole.poll
        monkeypatch.setattr(VerifierRole, "poll", lambda self: (time.sleep(0.01), poll(self)))
    drafter = start_drafter(overlap=overlap)
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=k)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, PROMPTS, GREEDY) == plain
    drafted, accepted = spec_counts(verifier)
    assert drafted >= 30 and accepted >= 0.9 * drafted
    if not overlap:  # (forced on a CPU, a step is computed before the last one's token goes out: later drafts)
        assert verifier.steps < 0.6 * 30  # several tokens per step (plain decoding takes one step per token)
    assert_idle_and_pages_back(verifier, drafter)


def test_a_different_drafter_has_few_drafts_accepted_and_changes_nothing(plain, stopper) -> None:
    drafter = start_drafter(seed=7)  # another random model with the same tokenizer
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=3)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, PROMPTS, GREEDY) == plain
    drafted, accepted = spec_counts(verifier)
    assert drafted >= 6 and accepted <= 0.2 * drafted
    # Drafts that keep failing pause speculation (draft_mesh/draft_policy.py): far fewer than K per token.
    assert drafted < 0.5 * 3 * sum(len(o) for o in plain)
    assert_idle_and_pages_back(verifier, drafter)


def test_every_token_a_drafter_streams_continues_its_base_under_the_overlap_scheduler(plain, stopper,
                                                                                     monkeypatch) -> None:
    """A drafter whose drafts are mostly wrong, its steps overlapped: commits keep cutting what it
    drafted while its next step is in flight. Each token it streams must be its own model's greedy
    token at that position after the committed tokens it names as its base (a token drafted after
    what a commit replaced is dropped, not sent)."""
    sent: list[pb.TailToken] = []
    send, poll = DrafterRole._send, VerifierRole.poll
    monkeypatch.setattr(DrafterRole, "_send", lambda self, lease_id, box: (sent.extend(box.tokens),
                                                                            send(self, lease_id, box)))
    # A verifier slower than its drafter, as on a GPU (the tiny drafter is the target's size here: one
    # that never gets ahead of the commits streams almost nothing, every token it computes already committed).
    monkeypatch.setattr(VerifierRole, "poll", lambda self: (time.sleep(0.01), poll(self)))
    drafter = start_drafter(seed=7, overlap=True)
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=3)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, PROMPTS, GREEDY) == plain
    assert_idle_and_pages_back(verifier, drafter)
    health = drafter.role.health_info()
    assert health["stale_dropped"] >= 3, health  # the case under test happened
    # The drafter model's own greedy continuation of each (request, base) the drafts name
    # (generate_tokens names prompt i's request "offline-<run>-<i>").
    sequences = [p + o for p, o in zip(PROMPTS, plain, strict=True)]
    prompt_of = {t.request_id: int(t.request_id.rsplit("-", 1)[1]) for t in sent}
    lengths: dict[tuple[int, int], int] = {}
    for t in sent:
        key = (prompt_of[t.request_id], t.base_committed_len)
        lengths[key] = max(lengths.get(key, 0), t.position - t.base_committed_len + 1)
    assert len(sent) >= 30 and len(lengths) >= 8
    reference = Engine(EngineConfig(model="tiny", seed=7, disable_prefix_cache=True, **ENGINE))
    stopper.append(reference)
    reference.start()
    keys = sorted(lengths)
    outs = generate_tokens(reference, [sequences[i][:base] for i, base in keys],
                           [SamplingParams(max_new_tokens=lengths[k], temperature=0.0, ignore_eos=True) for k in keys])
    expected = dict(zip(keys, outs, strict=True))
    wrong = [t for t in sent if t.token != expected[(prompt_of[t.request_id], t.base_committed_len)][
        t.position - t.base_committed_len]]
    assert not wrong, f"{len(wrong)} of {len(sent)} streamed tokens are not the drafter's continuation: {wrong[:3]}"


def binned_counts(a: Counter, b: Counter, min_count: int) -> list[list[int]]:
    """A 2 x n contingency table: tokens seen at least `min_count` times in all, the rest pooled."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= min_count]
    rest_a, rest_b = sum(a.values()) - sum(a[t] for t in common), sum(b.values()) - sum(b[t] for t in common)
    return [[a[t] for t in common] + [rest_a], [b[t] for t in common] + [rest_b]]


@pytest.mark.slow
def test_seeded_sampling_keeps_the_target_distribution(stopper) -> None:
    """Two-sample chi-squared tests on the tokens at output positions 1..7 (position 0 comes from
    the prefill): plain sampling against sampling through verification of greedy drafts. A request's
    first decode steps often run before its drafter has taken it in (they wait for no drafts then:
    DraftPolicy.primed), so how many of positions 1..3 were verified is a race (62-269 drafts under
    load); positions 4..7 come after the drafter has drafted for the request, so most are verified."""
    positions = range(1, 8)
    params = [SamplingParams(max_new_tokens=len(positions) + 1, temperature=0.8, seed=seed, ignore_eos=True)
              for seed in range(400)]
    prompt = [5, 6, 7]

    def sample(engine: Engine) -> list[list[int]]:
        outs: dict[str, list[int]] = {}
        done = threading.Semaphore(0)

        def collect(out: TokenOutput) -> None:
            outs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                assert out.error is None, out.error
                done.release()

        for i, p in enumerate(params):
            engine.submit(Request(f"s{i}", prompt, p, collect))
        for _ in params:
            assert done.acquire(timeout=120)
        return [outs[f"s{i}"] for i in range(len(params))]

    plain_engine = Engine(EngineConfig(model="tiny", **ENGINE))
    plain_engine.start()
    stopper.append(plain_engine)
    reference = sample(plain_engine)
    drafter = start_drafter()
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=3, wait_ms=200.0)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    speculative = sample(verifier)
    drafted, accepted = spec_counts(verifier)
    # Most of positions 4..7 went through verification (2,641-2,656 drafts in 8 runs, 3 of them beside
    # three busy processes), with both acceptance and rejection.
    assert drafted > 1000 and 0 < accepted < drafted, (drafted, accepted)
    for position in positions:
        a, b = Counter(o[position] for o in reference), Counter(o[position] for o in speculative)
        _, p_value, _, _ = chi2_contingency(binned_counts(a, b, min_count=10))
        assert p_value > 0.001, f"position {position}: {a.most_common(5)} vs {b.most_common(5)}"
    # The sharper test: how often the sampled token is the target's argmax given its prefix (what
    # a greedy drafter proposes, so what a biased accept/resample rule would over- or under-produce).
    greedy_one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    prefixes = [prompt + o[:j] for o in reference + speculative for j in positions]
    # In windows: 2,400 prompts at once would be over the engine's bounded inbox (--max-inbox).
    argmax = [t for i in range(0, len(prefixes), 400)
              for t in generate_tokens(plain_engine, prefixes[i:i + 400], greedy_one)]
    n = len(positions)
    hits = [argmax[i][0] == (reference + speculative)[i // n][1 + i % n] for i in range(len(prefixes))]
    half = len(hits) // 2
    table = [[sum(hits[:half]), half - sum(hits[:half])], [sum(hits[half:]), half - sum(hits[half:])]]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 0.001, f"argmax rate plain {table[0]} vs speculative {table[1]}"
    assert_idle_and_pages_back(verifier, drafter)


def test_two_verifiers_share_two_drafters(plain, stopper) -> None:
    drafters = [start_drafter(), start_drafter()]
    stopper.extend(drafters)
    verifiers = [start_verifier(drafters, k=3, rank=0), start_verifier(drafters, k=3, rank=1)]
    stopper.extend(verifiers)
    for v in verifiers:
        wait_joined(v, 2)
    assert all(d.role.health_info()["leases"] == 2 for d in drafters)
    for v in verifiers:
        assert generate_tokens(v, PROMPTS, GREEDY) == plain
        drafted, accepted = spec_counts(v)
        assert drafted > 0 and accepted >= 0.9 * drafted
    assert all(d.role.health_info()["drafted"] > 0 for d in drafters)  # each verifier spread its requests over both
    assert_idle_and_pages_back(*verifiers, *drafters)


def test_a_drafter_without_cudnn_attention_turns_off_sdpas_cudnn_backend(stopper) -> None:
    import torch

    assert torch.backends.cuda.cudnn_sdp_enabled()
    spec = SpecConfig(draft_mesh_port=free_port(), drafter_cudnn_attention=False)
    try:
        drafter = Engine(drafter_engine_config(EngineConfig(model="tiny", **ENGINE)),
                         role=ComposedRole("drafter", [DrafterRole(spec, TRANSFER)]))
        drafter.start()  # the role's attach sets it, before the engine warms up
        stopper.append(drafter)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert drafter.role.health_info()["leases"] == 0
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_join_is_refused_on_a_tokenizer_mismatch_with_the_reason(tmp_path, stopper) -> None:
    folder = write_checkpoint(tmp_path / "other-tokenizer", TINY_CONFIG, seed=0)
    tok = (folder / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_stop|>"')
    (folder / "tokenizer.json").write_text(tok)
    drafter = start_drafter(model=str(folder))
    stopper.append(drafter)
    verifier = start_verifier([drafter])
    stopper.append(verifier)
    deadline = time.monotonic() + 10
    while (link := verifier.role.health_info()["drafters"][mesh_endpoint(drafter)])["state"] != "refused":
        assert time.monotonic() < deadline, link
        time.sleep(0.05)
    assert "REFUSAL_TOKENIZER_MISMATCH" in link["detail"] and "tokenizer mismatch" in link["detail"]
    assert drafter.role.health_info()["leases"] == 0
    assert generate_tokens(verifier, PROMPTS[:1], GREEDY)  # it serves, without speculation
    assert spec_counts(verifier) == (0, 0)


def test_a_drafter_sends_its_last_draft_before_resting_at_once_under_the_overlap_scheduler(stopper,
                                                                                         monkeypatch) -> None:
    """Under the overlap scheduler the last draft before a request's limit is taken in by a loop turn
    that planned no step; it must go out then, not after the loop's idle sleep (made 5 s here)."""
    monkeypatch.setattr(drafter_module, "IDLE_POLL_S", 5.0)
    drafter = start_drafter(overlap=True)
    stopper.append(drafter)
    with joined_by_hand(drafter, verifier_rank=3, draft_tokens=1) as (_, lease, control, tails):
        time.sleep(0.2)  # the engine loop is idle, asleep
        started = time.monotonic()
        control.send_multipart(encode_frames(pb.DraftControlBatch(lease_id=lease.lease_id, items=[pb.DraftControl(
            sync=pb.DraftSync(request_id="r", prompt_ids=PROMPTS[0]))]), KEY))
        got: list[pb.TailToken] = []
        while len(got) < 3 and time.monotonic() - started < 1.0:  # 2K + 1 drafts for K = 1, within the lease
            if tails.poll(50):
                got.extend(decode_tails(tails.recv_multipart(), KEY).tokens)
        assert [t.position for t in got] == [5, 6, 7], f"{len(got)} drafts in {time.monotonic() - started:.2f} s"


def test_a_request_whose_tokens_commits_ran_past_still_gets_a_tail_that_tells_its_verifier() -> None:
    """A drafter as fast as its verifier, under the overlap scheduler, can have every token of a fresh request
    overtaken by commits (held, then settled): it drafts none, and a verifier waits for drafts only of requests
    it has had a tail of. The first settled token goes back as a tail drafted from the tokens before it (its base
    its own position): the verifier's buffer takes it and drops it against the tokens it has committed past it,
    offering nothing; later ones do not go, and none counts as drafted."""
    role = DrafterRole(SpecConfig(), TRANSFER)  # not attached: the held path needs no engine
    req = Request("draft:0:r", [1, 2, 3], SamplingParams(max_new_tokens=64, temperature=0.0), lambda out: None)
    state = role.states[req.request_id] = DraftState(req.request_id, "r", "lease", req, committed_len=3, ahead=9)
    state.held, state.committed_len = [7, 8], 5  # a commit of 7, 8 ran past the token on the device
    req.output_ids.append(7)  # that token arrives: the committed one
    assert role.on_token(req, None)
    (tail,) = role.outboxes["lease"].tokens
    assert (tail.request_id, tail.token, tail.position, tail.base_committed_len) == ("r", 7, 3, 3)
    assert req.output_ids == [7, 8] and not state.held and role.drafted_total == 0
    buffer = TailBuffer(start=3, floor=3)  # the verifier's, as it synced the request at 3 tokens
    assert buffer.add(tail.token, tail.base_committed_len, tail.position)
    assert buffer.reconcile([7, 8], offset=3) and buffer.draft(5, 4) == []  # committed already: nothing offered
    state.held, state.committed_len = [4], 6  # overtaken again
    req.output_ids.append(4)
    assert role.on_token(req, None) and len(role.outboxes["lease"].tokens) == 1  # told once is enough
    assert role.held_kept == 2


def test_a_tail_the_socket_would_not_take_is_told_again_by_the_next_overtaken_token() -> None:
    """A tail batch that the verifier's socket does not take (ZeroMQ's Again: here a socket with no connection
    to queue on) is dropped; its requests may then still be unprimed there, so the next token a commit overtook
    goes back."""
    role = DrafterRole(SpecConfig(), TRANSFER)  # not attached: _send needs a lease and a socket
    role.zmq = zmq.Context()
    try:
        lease = role.leases.grant(0, "v", "tcp://127.0.0.1:1", 4)
        sock = role.zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a finished connection: none will come
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{free_port()}")
        role.tail_sockets[lease.lease_id] = sock
        req = Request(drafter_module.draft_key(0, "r"), [1, 2, 3], SamplingParams(max_new_tokens=64), lambda out: None)
        state = role.states[req.request_id] = DraftState(req.request_id, "r", lease.lease_id, req, committed_len=5,
                                                         ahead=9)
        state.held = [7, 8]
        req.output_ids.append(7)
        role.on_token(req, None)
        assert state.streamed
        role._send(lease.lease_id, role.outboxes.pop(lease.lease_id))  # Again: dropped
        assert not state.streamed
        state.held, state.committed_len = [4], 6
        req.output_ids.append(4)
        role.on_token(req, None)
        assert [(t.token, t.position) for t in role.outboxes[lease.lease_id].tokens] == [(4, 5)]
    finally:
        role.zmq.destroy(linger=0)  # its sockets too


def test_corrupt_messages_quarantine_one_request_each(stopper) -> None:
    drafter = start_drafter()
    stopper.append(drafter)
    start = drafter.kv.usage()
    with joined_by_hand(drafter, verifier_rank=4, draft_tokens=4) as (caller, lease, control, tails):

        def send(*items: pb.DraftControl, key: str = KEY) -> None:
            control.send_multipart(encode_frames(pb.DraftControlBatch(lease_id=lease.lease_id, items=items), key))

        def commit(rid: str, start_at: int, tokens: list[int]) -> pb.DraftControl:
            return pb.DraftControl(commit=pb.VerifyCommit(request_id=rid, pre_verify_committed_len=start_at,
                                                          tokens=tokens))

        send(*(pb.DraftControl(sync=pb.DraftSync(request_id=f"r{i}", prompt_ids=[1, 2, 3], output_ids=[4]))
               for i in range(6)))
        control.send_multipart([b"garbage"])  # malformed frames: dropped, nothing else happens
        send(commit("r0", 4, [5]), key="00" * 16)  # not signed with the group's key: dropped
        send(commit("r0", 6, [5]),  # a gap
             commit("r1", 3, [5]),  # an overlap
             commit("r2", 4, [10_000]),  # a token outside the vocabulary
             pb.DraftControl(sync=pb.DraftSync(request_id="r3", prompt_ids=[])),  # a sync with no prompt
             commit("never-synced", 4, [5]),
             pb.DraftControl(pace=pb.DraftPace(request_id="r5", ahead=-1)),  # a negative pace
             commit("r4", 4, [9]))  # valid: r4 goes on drafting
        quarantined: dict[str, str] = {}
        drafted_after_commit: list[pb.TailToken] = []
        deadline = time.monotonic() + 20
        while (len(quarantined) < 6 or not drafted_after_commit) and time.monotonic() < deadline:
            if tails.poll(200):
                batch = decode_tails(tails.recv_multipart(), KEY)
                quarantined.update({q.request_id: q.reason for q in batch.quarantined})
                drafted_after_commit += [t for t in batch.tokens if t.request_id == "r4" and t.base_committed_len == 5]
        assert set(quarantined) == {"r0", "r1", "r2", "r3", "r5", "never-synced"}
        assert "gap" in quarantined["r0"] and "overlap" in quarantined["r1"] and "outside" in quarantined["r2"]
        assert drafted_after_commit and drafted_after_commit[0].position == 5
        health = drafter.role.health_info()
        assert health["dropped_messages"] == 2 and health["quarantined"] == 6 and health["draft_requests"] == 1
        send(pb.DraftControl(close=pb.DraftClose(request_id="r4")))
        assert_idle_and_pages_back(drafter)
        end = drafter.kv.usage()  # the drafter's prefix cache may keep what the requests computed
        assert (end.free + end.cached, end.locked, end.slots_in_use) == (start.free + start.cached, 0, 0)
        caller.call("Leave", pb.LeaveRequest(lease_id=lease.lease_id))


def test_a_drafter_prefills_only_what_its_prefix_cache_lacks_and_drafts_the_same(stopper) -> None:
    """A DraftSync of a sequence the drafter held before (a closed request's, or one with the same
    prompt) takes its full pages from the drafter's prefix cache: the sync prefills the rest only,
    drafts the same tokens, and a commit that cuts its drafts frees the request's own pages alone."""
    drafter = start_drafter()
    stopper.append(drafter)
    start = drafter.kv.usage()
    prompt = list(range(20, 33))  # 13 tokens: 3 full pages of 4
    computed = drafter.metrics.prompt_tokens_computed
    with joined_by_hand(drafter, verifier_rank=2, draft_tokens=2) as (caller, lease, control, tails):

        def send(*items: pb.DraftControl) -> None:
            control.send_multipart(encode_frames(pb.DraftControlBatch(lease_id=lease.lease_id, items=items), KEY))

        def drafts(rid: str, base: int, count: int) -> list[int]:
            got: list[pb.TailToken] = []
            deadline = time.monotonic() + 20
            while len(got) < count and time.monotonic() < deadline:
                if tails.poll(100):
                    got += [t for t in decode_tails(tails.recv_multipart(), KEY).tokens
                            if t.request_id == rid and t.base_committed_len == base]
            assert len(got) >= count, f"{rid}: {len(got)} drafts"
            assert [t.position for t in got[:count]] == list(range(base, base + count))
            return [t.token for t in got[:count]]

        runs = []
        for rid in ("a", "b"):
            before = computed._value.get()
            send(pb.DraftControl(sync=pb.DraftSync(request_id=rid, prompt_ids=prompt)))
            tokens = drafts(rid, len(prompt), 5)  # 2K + 1 past the commit
            runs.append((tokens, computed._value.get() - before))
            send(pb.DraftControl(close=pb.DraftClose(request_id=rid)))
            assert_idle_and_pages_back(drafter)
        assert runs[0][0] == runs[1][0]
        assert runs[0][1] == len(prompt) and runs[1][1] == 1, runs  # 12 tokens (3 pages) from the cache
        # Over the cached prompt, a commit that rejects the first draft cuts the request's own pages only.
        send(pb.DraftControl(sync=pb.DraftSync(request_id="c", prompt_ids=prompt)))
        first = drafts("c", len(prompt), 1)[0]
        wrong = (first + 1) % drafter.model_cfg.vocab_size
        send(pb.DraftControl(commit=pb.VerifyCommit(request_id="c", pre_verify_committed_len=len(prompt),
                                                    tokens=[wrong])))
        drafts("c", len(prompt) + 1, 3)
        assert drafter.role.health_info()["quarantined"] == 0
        send(pb.DraftControl(close=pb.DraftClose(request_id="c")))
        assert_idle_and_pages_back(drafter)
        end = drafter.kv.usage()
        assert end.cached > 0 and (end.free + end.cached, end.locked) == (start.free + start.cached, 0)
        caller.call("Leave", pb.LeaveRequest(lease_id=lease.lease_id))


def test_structured_output_through_verification_equals_plain(stopper) -> None:
    from splitserve.engine.grammar.spec import GrammarSpec

    params = SamplingParams(max_new_tokens=24, temperature=0.0, grammar=GrammarSpec("regex", "[a-m]{4,12}[0-9]{3}x"))
    plain_engine = Engine(EngineConfig(model="tiny", **ENGINE))
    plain_engine.start()
    stopper.append(plain_engine)
    reference = generate_tokens(plain_engine, PROMPTS, params)
    drafter = start_drafter()
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=3)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, PROMPTS, params) == reference
    drafted, accepted = spec_counts(verifier)
    assert drafted > 0 and accepted < drafted  # the drafter ignores the grammar: the verifier holds to it
    text = verifier.tokenizer.decode(reference[0])
    assert re.fullmatch("[a-m]{4,12}[0-9]{3}x", text), text
    assert_idle_and_pages_back(verifier, drafter)


def test_stop_strings_and_aborts_behave_as_without_speculation(plain, stopper) -> None:
    drafter = start_drafter()
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=4)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    text = verifier.tokenizer.decode(plain[0])
    stop = text[10:13]
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    plain_engine = Engine(EngineConfig(model="tiny", **ENGINE))
    plain_engine.start()
    stopper.append(plain_engine)
    assert generate_tokens(verifier, PROMPTS[:1], params) == generate_tokens(plain_engine, PROMPTS[:1], params)

    outs: list[TokenOutput] = []
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    verifier.submit(Request("to-abort", PROMPTS[0], long, outs.append))
    deadline = time.monotonic() + 20
    while sum(len(o.token_ids) for o in outs) < 40:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert drafter.role.health_info()["draft_requests"] == 1
    verifier.abort("to-abort")
    deadline = time.monotonic() + 10
    while not outs[-1].finish_reason:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert outs[-1].finish_reason.value == "abort"
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == generate_tokens(plain_engine, PROMPTS[:1], long)[0][: len(tokens)]
    assert_idle_and_pages_back(verifier, drafter)  # the drafter closed it too
    assert drafter.role.health_info()["draft_requests"] == 0


def write_peers(path, drafters: list[Engine]) -> None:
    endpoints = [{"host": "127.0.0.1", "meshPort": d.role.health_info()["draft_mesh_port"]} for d in drafters]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"roles": {"drafter": {"endpoints": endpoints}}}))
    tmp.replace(path)  # as a ConfigMap update swaps the file: never half written


def test_drafters_added_to_the_peers_file_later_are_joined_and_removed_ones_left(tmp_path, plain, stopper) -> None:
    peers = tmp_path / "peers.json"
    write_peers(peers, [])
    spec = SpecConfig(peers_file=str(peers), num_draft_tokens=3, draft_wait_ms=WAIT_MS, speculation_gate=False)
    role = ComposedRole("unified", [VerifierRole(spec, TRANSFER)])
    verifier = Engine(EngineConfig(model="tiny", **ENGINE), role=role)
    verifier.start()
    stopper.append(verifier)
    assert generate_tokens(verifier, PROMPTS[:1], GREEDY) == plain[:1]  # no drafter yet: plain decoding
    assert spec_counts(verifier) == (0, 0)
    drafter = start_drafter()
    stopper.append(drafter)
    write_peers(peers, [drafter])
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, PROMPTS, GREEDY) == plain
    drafted, accepted = spec_counts(verifier)
    assert drafted > 0 and accepted >= 0.9 * drafted
    write_peers(peers, [])
    deadline = time.monotonic() + 5
    while verifier.role.health_info()["drafters"] or drafter.role.health_info()["leases"]:
        assert time.monotonic() < deadline, (verifier.role.health_info(), drafter.role.health_info())
        verifier.call_soon(lambda: None)
        time.sleep(0.05)
    assert generate_tokens(verifier, PROMPTS, GREEDY) == plain and spec_counts(verifier) == (drafted, accepted)
    assert_idle_and_pages_back(verifier, drafter)


@pytest.mark.parametrize(("seed", "budget"), [(0, False), (7, False), (0, True), (7, True)])
def test_the_gate_keeps_the_faster_mode_and_switching_changes_no_token(seed, budget, stopper) -> None:
    # The gate measures both modes (speculating first, or with the budget plain decoding first; while
    # plain, commits are held and the drafter paced to nothing) and keeps the faster, probing the other
    # later; the catch-up commits and re-drafts of every switch must leave greedy output exactly plain
    # decoding's. Which mode wins on a loaded CPU is not the point here (draft_mesh tests check the choice).
    params = SamplingParams(max_new_tokens=70, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS * 2
    plain_engine = Engine(EngineConfig(model="tiny", **ENGINE))
    plain_engine.start()
    try:
        reference = generate_tokens(plain_engine, prompts, params)
    finally:
        plain_engine.stop()
    drafter = start_drafter(seed=seed)
    stopper.append(drafter)
    verifier = start_verifier([drafter], k=3, gate=True, budget=budget)
    stopper.append(verifier)
    wait_joined(verifier, 1)
    assert generate_tokens(verifier, prompts, params) == reference
    (role,) = verifier.role.behaviours
    rates = role.gate.rates
    assert rates[(8, PLAIN)] > 0 and rates[(8, SPECULATE)] > 0  # both measured: it switched at least once
    # What it decided and why is on /health (the engine serves health_info) and in the metrics. The
    # run's last step is charged at the loop's next poll; the saved-seconds gauge is copied at switches
    # and every GATE_SUMMARY_EVERY polls, which the idle loop keeps making.
    def loop_turn() -> None:  # returns once the loop has started a turn after this call
        turned = threading.Event()
        verifier.call_soon(turned.set)
        assert turned.wait(5)

    loop_turn()
    loop_turn()  # this turn began after a poll that followed the run's last step
    # Every token of every decoding step was counted, those of each request's last step too (the first
    # came from the prompts' one prefill step, which the gate does not time).
    assert role.gate.observed_tokens == sum(len(o) for o in reference) - len(prompts)
    saved = sum(b.saved_s for b in role.gate.budgets.values())
    registry = verifier.metrics.registry
    deadline = time.monotonic() + 5
    while registry.get_sample_value("splitserve_spec_gate_saved_seconds", {"model": "tiny"}) != pytest.approx(
            saved, abs=1e-6):
        assert time.monotonic() < deadline, saved
        time.sleep(0.05)  # idle polls: IDLE_WAIT_S apart
    gate = verifier.role.health_info()["speculation_gate"]
    # Drafts were verified, or (with the budget, a wrong drafter on a loaded CPU) its first probe spent
    # the budget before the drafter had drafted: the gate says so.
    assert spec_counts(verifier)[0] > 0 or (budget and gate["switches"].get("plain/budget", 0) >= 1), gate
    assert gate["mode"] in (PLAIN, SPECULATE) and gate["switches"] == role.gate.switches
    assert sum(gate["switches"].values()) >= 1 and gate["buckets"]["8"]["plain_tokens_per_s"] > 0
    assert gate["buckets"]["8"]["cap_ms"] > 0 and gate["buckets"]["8"]["headroom_ms"] is not None
    for key, count in gate["switches"].items():
        mode, why = key.split("/")
        assert registry.get_sample_value("splitserve_spec_gate_switches_total",
                                         {"model": "tiny", "mode": mode, "reason": why}) == count
    assert registry.get_sample_value("splitserve_spec_gate_speculating", {"model": "tiny"}) in (0.0, 1.0)
    assert_idle_and_pages_back(verifier, drafter)
