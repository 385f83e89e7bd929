"""Control messages between the two sides of a transfer, and their wire format.

Every message travels as three ZeroMQ frames: ``b"ss1"``, a MAC, and a JSON body whose
``kind`` names the message. With a shared key (``transfer_control_key``) the MAC is
HMAC-SHA256 of the body and a message without the right MAC is dropped; without a key the MAC
frame is empty. ``decode_message`` validates every field's type, so garbage raises
``ControlMessageError`` (the channel logs and drops it) instead of reaching the rooms.

Direction and meaning:
- ``KVMetadata`` decode rank -> prefill rank: where this room's pages go.
- ``TransferStatus`` prefill rank -> decode rank: progress (Transferring), Success, Failed.
- ``RoomsDone`` prefill rank -> decode rank: Success of the rooms one merged write finished.
- ``AbortRoom`` either way: the room is dead on the sending side. Decode repeats it for a fenced
  room (write_fence.py) until every prefill rank answered ``RoomFenced``.
- ``RoomFenced`` prefill rank -> decode rank: no write of mine for this room is in flight, and
  none will start.
- ``Ping`` / ``Pong`` either way: heartbeats; ``instance`` reveals a restarted peer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from splitserve.transfer.errors import ControlMessageError

WIRE_VERSION = b"ss1"


@dataclass(frozen=True)
class KVMetadata:
    """Decode rank -> prefill rank: write this room's KV into these pages.

    ``dst_pages`` covers the whole prompt (including the ``decode_prefix_len`` tokens decode
    already holds, which are not sent). The prefill rank writes heads
    ``[head_start, head_start + head_count)``, and the aux slot when ``write_aux``.
    ``expected_dsts`` is how many decode ranks send metadata to this prefill rank for the room.
    ``dst_layout_digest`` names the decode rank's layout (``kv_layout.layout_digest``); the layout
    itself (``dst_layout``) comes only with the first room to a prefill instance (and again after
    a room to it failed), ``{}`` otherwise: the prefill keeps the layouts it was sent by digest.
    ``write_by`` (wall clock, seconds since the epoch) is the decode's deadline: the prefill starts
    no write for the room after it, so a prefill that froze and resumes cannot write into pages
    the decode gave to another request since.
    """

    kind: ClassVar[str] = "kv_metadata"
    room: int
    bootstrap_addr: str
    reply_to: str
    instance: str
    decode_rank: int
    expected_dsts: int
    dst_layout: dict
    dst_layout_digest: str
    dst_pages: list[int]
    dst_aux_index: int
    decode_prefix_len: int
    head_start: int
    head_count: int
    write_aux: bool
    write_by: float


@dataclass(frozen=True)
class TransferStatus:
    """Prefill rank -> decode rank: the room's state on the sender (3, 4 or 0)."""

    kind: ClassVar[str] = "transfer_status"
    room: int
    bootstrap_addr: str
    reply_to: str
    instance: str
    prefill_rank: int
    state: int
    pages_done: int
    reason: str


@dataclass(frozen=True)
class RoomsDone:
    """Prefill rank -> decode rank: ``Success`` of several rooms at once (one merged write's), as one
    ``TransferStatus`` each would say, with each room's pages."""

    kind: ClassVar[str] = "rooms_done"
    rooms: list[int]
    pages_done: list[int]
    bootstrap_addr: str
    reply_to: str
    instance: str
    prefill_rank: int

    def statuses(self) -> list[TransferStatus]:
        """The ``TransferStatus`` (Success) of each room."""
        return [TransferStatus(room, self.bootstrap_addr, self.reply_to, self.instance, self.prefill_rank, 4,
                               pages, "") for room, pages in zip(self.rooms, self.pages_done, strict=False)]


@dataclass(frozen=True)
class AbortRoom:
    """Either side: this room failed or was aborted here; fail it on your side too."""

    kind: ClassVar[str] = "abort_room"
    room: int
    bootstrap_addr: str
    reply_to: str
    instance: str
    reason: str


@dataclass(frozen=True)
class RoomFenced:
    """Prefill rank -> decode rank, the answer to an ``AbortRoom``: this rank has no write for the
    room in flight and will start none (the decode may reuse the room's pages)."""

    kind: ClassVar[str] = "room_fenced"
    room: int
    bootstrap_addr: str
    reply_to: str
    instance: str


@dataclass(frozen=True)
class Ping:
    """Heartbeat request; answered by a ``Pong`` to ``reply_to``."""

    kind: ClassVar[str] = "ping"
    reply_to: str
    instance: str
    seq: int


@dataclass(frozen=True)
class Pong:
    """Heartbeat answer; ``instance`` changes when the peer restarted."""

    kind: ClassVar[str] = "pong"
    reply_to: str
    instance: str
    seq: int


ControlMessage = KVMetadata | TransferStatus | RoomsDone | AbortRoom | RoomFenced | Ping | Pong
MESSAGE_TYPES: dict[str, type] = {cls.kind: cls for cls in (KVMetadata, TransferStatus, RoomsDone, AbortRoom,
                                                            RoomFenced, Ping, Pong)}


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, Callable[[Any], bool]], ...]:
    """(name, type hint, its checker) of each field of a message class, worked out once: a room sends and
    receives several messages, and ``get_type_hints`` costs more than the rest of decoding."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], _checker(hints[f.name])) for f in dataclasses.fields(cls))


def encode_message(msg: ControlMessage, key: bytes = b"") -> list[bytes]:
    """The frames of ``msg``; signed when ``key`` is set."""
    body = {name: getattr(msg, name) for name, _, _ in _fields(type(msg))}  # JSON copies nested values itself
    body["kind"] = msg.kind
    raw = json.dumps(body, separators=(",", ":")).encode()
    mac = hmac.new(key, raw, hashlib.sha256).digest() if key else b""
    return [WIRE_VERSION, mac, raw]


def decode_message(frames: list[bytes], key: bytes = b"", types: dict[str, type] | None = None) -> ControlMessage:
    """Parses and validates frames; raises ``ControlMessageError`` on anything unexpected.
    ``types`` is the message set the channel speaks (default: the KV messages)."""
    if len(frames) != 3 or frames[0] != WIRE_VERSION:
        raise ControlMessageError(f"expected 3 frames starting {WIRE_VERSION!r}, got {len(frames)} "
                                  f"frames starting {frames[0][:16]!r}" if frames else "empty message")
    _, mac, raw = frames
    if key:
        expected = hmac.new(key, raw, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise ControlMessageError("bad MAC: sender does not hold the control key")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlMessageError(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ControlMessageError(f"body must be an object, got {type(body).__name__}")
    kind = body.get("kind")
    cls = (MESSAGE_TYPES if types is None else types).get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ControlMessageError(f"unknown message kind {kind!r}")
    values: dict[str, Any] = {}
    for name, hint, has_type in _fields(cls):
        if name not in body:
            raise ControlMessageError(f"{cls.kind}: missing field {name!r}")
        value = body[name]
        if not has_type(value):
            raise ControlMessageError(f"{cls.kind}.{name}: expected {hint}, got {type(value).__name__}")
        values[name] = float(value) if hint is float else value
    return cls(**values)


def _checker(annotation: Any) -> Callable[[Any], bool]:
    """A test of whether a decoded JSON value has type ``annotation``, built once per field: a room's page
    list is checked element by element, and walking ``typing`` per element cost most of a message's decode.
    JSON gives exact ``int`` / ``float`` / ``str`` (never subclasses); ``bool`` is not an ``int`` here."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if item is int:
            return lambda v: type(v) is list and all(type(x) is int for x in v)
        check = _checker(item)
        return lambda v: isinstance(v, list) and all(check(x) for x in v)
    if origin in (typing.Union, types.UnionType):
        checks = [_checker(a) for a in typing.get_args(annotation)]
        return lambda v: any(c(v) for c in checks)
    if annotation is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if annotation is float:  # finite only: a NaN deadline would never pass
        return lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return lambda v: isinstance(v, annotation)
