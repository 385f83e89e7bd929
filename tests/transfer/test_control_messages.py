"""Control messages: round trip, validation of every field, MAC."""

from __future__ import annotations

import pytest

from splitserve.transfer.control_messages import AbortRoom, Ping, TransferStatus, decode_message, encode_message
from splitserve.transfer.errors import ControlMessageError


def test_messages_round_trip_signed_and_unsigned():
    msg = TransferStatus(7, "h:1", "tcp://a:1", "inst", 0, 3, 12, "")
    assert decode_message(encode_message(msg)) == msg
    assert decode_message(encode_message(msg, b"k"), b"k") == msg


@pytest.mark.parametrize("frames", [
    [],
    [b"ss1", b""],
    [b"v0", b"", b"{}"],
    [b"ss1", b"", b"not json"],
    [b"ss1", b"", b'{"kind": "abort_room", "room": 1}'],
    [b"ss1", b"", b'{"kind": "ping", "reply_to": "x", "instance": "i", "seq": true}'],
    [b"ss1", b"", b'{"kind": "kv_metadata"}'],
])
def test_garbage_raises_control_message_error(frames):
    with pytest.raises(ControlMessageError):
        decode_message(frames)


def test_wrong_or_missing_mac_is_refused():
    frames = encode_message(AbortRoom(1, "h:1", "tcp://a:1", "i", "why"), b"right")
    with pytest.raises(ControlMessageError, match="MAC"):
        decode_message(frames, b"wrong")
    with pytest.raises(ControlMessageError, match="MAC"):
        decode_message(encode_message(Ping("tcp://a:1", "i", 1)), b"right")
