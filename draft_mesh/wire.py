"""The draft mesh's ZeroMQ messages: three frames, ``b"sdm1"``, a MAC and a protobuf body.

With the group's key the MAC is HMAC-SHA256 of the body and a message without the right MAC is
dropped; without a key the MAC frame is empty. Nothing from the network is unpickled: bodies
are `DraftControlBatch` (verifier -> drafter) or `TailBatch` (drafter -> verifier) messages.
A message that does not parse raises `WireError`; the receive loop logs and drops it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from splitserve.proto import draft_mesh_pb2 as pb

WIRE_VERSION = b"sdm1"
M = TypeVar("M", bound=Message)


class WireError(ValueError):
    """A frame set that is not a well-formed, authentic draft mesh message."""


def encode_frames(msg: Message, key: str = "") -> list[bytes]:
    body = msg.SerializeToString()
    mac = hmac.new(key.encode(), body, hashlib.sha256).digest() if key else b""
    return [WIRE_VERSION, mac, body]


def decode_frames(frames: list[bytes], cls: type[M], key: str = "") -> M:
    if len(frames) != 3 or frames[0] != WIRE_VERSION:
        head = frames[0][:16] if frames else b""
        raise WireError(f"expected 3 frames starting {WIRE_VERSION!r}, got {len(frames)} starting {head!r}")
    _, mac, body = frames
    if key and not hmac.compare_digest(mac, hmac.new(key.encode(), body, hashlib.sha256).digest()):
        raise WireError("bad MAC: the sender does not hold the group's key")
    msg = cls()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise WireError(f"body is not a {cls.__name__}: {exc}") from exc
    return msg


def decode_control(frames: list[bytes], key: str = "") -> pb.DraftControlBatch:
    return decode_frames(frames, pb.DraftControlBatch, key)


def decode_tails(frames: list[bytes], key: str = "") -> pb.TailBatch:
    return decode_frames(frames, pb.TailBatch, key)
