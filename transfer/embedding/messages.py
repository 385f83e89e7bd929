"""Control messages of the embedding transfer (encode -> prefill), in the KV messages' wire format
(three frames, HMAC under the group's key, every field type-checked on arrival).

- ``EmbeddingWanted`` prefill rank -> encoder: for ``room``, write ``rows`` x ``hidden`` of ``dtype``
  (``nbytes``) at ``dst_ptr`` of Mooncake session ``session``; sent only once a slot is leased. The
  encoder starts no write for the room after ``write_by`` (wall clock, seconds since the epoch).
- ``EmbeddingStatus`` encoder -> prefill rank: the rows landed (state 2) or the item failed (state 0).
- ``EmbeddingAbort`` prefill rank -> encoder: the room is given up; write nothing more. Repeated
  every heartbeat interval while the room's slot is fenced (write_fence.py).
- ``EmbeddingFenced`` encoder -> prefill rank, the answer to an abort: no write of mine for the
  room is in flight and none will start (the slot may be reused).
- ``Ping`` / ``Pong``: the KV heartbeats, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from splitserve.transfer.control_messages import Ping, Pong


@dataclass(frozen=True)
class EmbeddingWanted:
    kind: ClassVar[str] = "embedding_wanted"
    room: int
    reply_to: str
    instance: str
    session: str
    dst_ptr: int
    nbytes: int
    rows: int
    hidden: int
    dtype: str
    digest: str
    write_by: float


@dataclass(frozen=True)
class EmbeddingStatus:
    kind: ClassVar[str] = "embedding_status"
    room: int
    reply_to: str
    instance: str
    state: int
    rows: int
    reason: str


@dataclass(frozen=True)
class EmbeddingAbort:
    kind: ClassVar[str] = "embedding_abort"
    room: int
    reply_to: str
    instance: str
    reason: str


@dataclass(frozen=True)
class EmbeddingFenced:
    kind: ClassVar[str] = "embedding_fenced"
    room: int
    reply_to: str
    instance: str


EMBEDDING_MESSAGE_TYPES: dict[str, type] = {
    cls.kind: cls for cls in (EmbeddingWanted, EmbeddingStatus, EmbeddingAbort, EmbeddingFenced,
                              Ping, Pong)}
