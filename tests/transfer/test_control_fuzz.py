"""Control messages fuzzed: the decoder on thousands of generated frames and bodies, and a real
manager's control socket fed garbage (undecodable frames, bad MACs, and well-typed messages
with nonsense values) over real ZeroMQ. Nothing may raise but ControlMessageError, the control
thread lives, and a real Mooncake transfer succeeds afterwards."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.transfer import KVPoll, KVReceiver, KVSender
from splitserve.transfer.control_messages import (
    MESSAGE_TYPES,
    WIRE_VERSION,
    AbortRoom,
    KVMetadata,
    Ping,
    Pong,
    RoomFenced,
    RoomsDone,
    TransferStatus,
    decode_message,
    encode_message,
)
from splitserve.transfer.errors import ControlMessageError

from .conftest import FAST, poll_until_final, wait_until

EXAMPLES = 1000
KEY = b"fuzz-key"
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=10)
TYPED = {int: st.integers(-5, 60) | st.integers(), str: st.text(max_size=30) | st.just("tcp://127.0.0.1:1"),
         bool: st.booleans(), float: st.floats(allow_nan=False, allow_infinity=False),
         dict: st.dictionaries(st.text(max_size=8), JSON, max_size=4),
         list[int]: st.lists(st.integers(-3, 200), max_size=8)}


@st.composite
def message_body(draw) -> dict:
    """A body whose kind is (usually) real and whose fields are (usually) of the right type."""
    kind = draw(st.sampled_from([*MESSAGE_TYPES, "bogus"]))
    body: dict = {"kind": kind}
    cls = MESSAGE_TYPES.get(kind, Ping)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        choice = draw(st.sampled_from(["typed", "typed", "typed", "garbage", "missing"]))
        if choice == "typed":
            body[f.name] = draw(TYPED[hints[f.name]])
        elif choice == "garbage":
            body[f.name] = draw(JSON)
    if draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(JSON)
    return body


@st.composite
def frames(draw, key: bytes = b"") -> list[bytes]:
    """Anything a socket might deliver: random frames, bad versions, bad MACs, bodies of every shape."""
    shape = draw(st.sampled_from(["random", "body", "body", "signed-body", "bad-json"]))
    if shape == "random":
        return draw(st.lists(st.binary(max_size=40), max_size=5))
    raw = json.dumps(draw(message_body() | JSON)).encode() if shape != "bad-json" else draw(st.binary(max_size=60))
    if shape == "signed-body" and key:
        import hashlib
        import hmac
        return [WIRE_VERSION, hmac.new(key, raw, hashlib.sha256).digest(), raw]
    return [draw(st.sampled_from([WIRE_VERSION, b"ss0", b""])), draw(st.binary(max_size=32)), raw]


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(frames(KEY), st.booleans())
def test_the_decoder_raises_only_control_message_errors(data: list[bytes], keyed: bool) -> None:
    try:
        msg = decode_message(data, KEY if keyed else b"")
    except ControlMessageError:
        return
    hints = typing.get_type_hints(type(msg))
    for f in dataclasses.fields(msg):  # what gets through is exactly of the declared types
        value = getattr(msg, f.name)
        expected = hints[f.name]
        if typing.get_origin(expected) is list:
            assert isinstance(value, list) and all(type(v) is int for v in value)
        else:
            assert type(value) is expected, (f.name, value)


MESSAGES = st.one_of(
    st.builds(KVMetadata, room=st.integers(0, 2**63 - 1), bootstrap_addr=st.text(), reply_to=st.text(),
              instance=st.text(), decode_rank=st.integers(0, 8), expected_dsts=st.integers(1, 8),
              dst_layout=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
              dst_layout_digest=st.text(max_size=80),
              dst_pages=st.lists(st.integers(0, 10**6)), dst_aux_index=st.integers(0, 100),
              decode_prefix_len=st.integers(0, 100), head_start=st.integers(0, 8), head_count=st.integers(1, 8),
              write_aux=st.booleans(), write_by=st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(TransferStatus, room=st.integers(0, 2**63 - 1), bootstrap_addr=st.text(), reply_to=st.text(),
              instance=st.text(), prefill_rank=st.integers(0, 8), state=st.integers(0, 4),
              pages_done=st.integers(0, 10**6), reason=st.text()),
    st.builds(RoomsDone, rooms=st.lists(st.integers(0, 2**63 - 1)), pages_done=st.lists(st.integers(0, 10**6)),
              bootstrap_addr=st.text(), reply_to=st.text(), instance=st.text(), prefill_rank=st.integers(0, 8)),
    st.builds(AbortRoom, room=st.integers(0, 2**63 - 1), bootstrap_addr=st.text(), reply_to=st.text(),
              instance=st.text(), reason=st.text()),
    st.builds(RoomFenced, room=st.integers(0, 2**63 - 1), bootstrap_addr=st.text(), reply_to=st.text(),
              instance=st.text()),
    st.builds(Ping, reply_to=st.text(), instance=st.text(), seq=st.integers(0, 2**62)),
    st.builds(Pong, reply_to=st.text(), instance=st.text(), seq=st.integers(0, 2**62)),
)


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(MESSAGES, st.sampled_from([b"", KEY]))
def test_every_message_survives_encode_then_decode(msg, key: bytes) -> None:
    assert decode_message(encode_message(msg, key), key) == msg


@pytest.mark.slow
def test_a_manager_fed_garbage_keeps_its_control_thread_and_transfers_after(bootstrap, make_rank) -> None:
    prefill, decode = make_rank(seed=3), make_rank()
    prefill.mgr.publish_layout(bootstrap.address)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(prefill.mgr.endpoint)
    sent = {"n": 0}
    try:
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(frames())
        def feed(data: list[bytes]) -> None:
            if data:  # ZeroMQ sends no empty multipart message
                push.send_multipart(data)
                sent["n"] += 1

        received_before = prefill.mgr.channel.received
        feed()
        assert wait_until(lambda: prefill.mgr.channel.received - received_before >= sent["n"], 20), \
            (prefill.mgr.channel.received - received_before, sent["n"])
    finally:
        push.close()
        ctx.term()
    assert sent["n"] >= 990
    assert prefill.mgr.channel._thread.is_alive()
    assert prefill.mgr.stats()["dropped_messages"] > 0
    assert prefill.mgr.stats()["rooms"] == 0
    # The manager still moves KV.
    sender = KVSender(prefill.mgr, bootstrap.address, 7777)
    receiver = KVReceiver(decode.mgr, bootstrap.address, 7777)
    receiver.init()
    receiver.send_metadata([5, 6], 0)
    sender.init(2, 0)
    sender.send([9, 10], last_chunk=True)
    poll_until_final([sender, receiver])
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    sender.clear()
    receiver.clear()
    # Sockets opened to answer garbage pings close once idle.
    assert wait_until(lambda: prefill.mgr.stats()["peer_sockets"] <= 1, 3 * FAST.heartbeat_timeout_s + 2), \
        prefill.mgr.stats()
