"""The contract the engine's scheduler sees: a manager per engine, a sender or receiver per room.

Backends (today only Mooncake: ``kv_manager``, ``kv_sender``, ``kv_receiver``) implement it.
Every method returns quickly: no method blocks on the network, and ``poll`` only reads the
room's state (moved by the manager's threads under its lock).

Prefill (sender) per request, on the scheduler loop::

    sender = KVSender(mgr, bootstrap_addr, room)      # when the request arrives
    sender.init(num_kv_pages, aux_index)              # once its pages are known
    sender.send(pages_of_this_chunk, last_chunk)      # after each prefill chunk; aux with the last
    state = sender.poll()                             # each step (agree across TP ranks)
    sender.clear()                                    # on Success/Failed, then free the pages

Decode (receiver) per request::

    receiver = KVReceiver(mgr, bootstrap_addr, room)
    receiver.init()                                   # starts resolving the prefill's layout
    receiver.send_metadata(pages, aux_index, decode_prefix_len)
    state = receiver.poll()                           # each step; Success: pages + aux landed
    receiver.clear()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from splitserve.transfer.errors import KVTransferError
from splitserve.transfer.poll_state import KVPoll


class BaseKVManager(ABC):
    """Owns the transport, the registered KV and aux buffers, and the transfer threads."""

    @abstractmethod
    def close(self) -> None:
        """Fails every open room, stops the threads, releases the transport."""


class BaseKVSender(ABC):
    """Prefill side of one room: writes the request's KV pages and aux data to decode."""

    @abstractmethod
    def init(self, num_kv_pages: int, aux_index: int) -> None:
        """The prompt spans ``num_kv_pages`` pages; its aux data sits in slot ``aux_index``."""

    @abstractmethod
    def send(self, kv_page_indices: Sequence[int], last_chunk: bool) -> None:
        """Sends the next pages of the prompt (in prompt order); the aux data goes with the last.

        Non-last chunks must hold only complete pages. Sending before the decode's metadata
        arrived is allowed: chunks wait for it.
        """

    @abstractmethod
    def poll(self) -> KVPoll:
        """The room's state; never blocks."""

    @abstractmethod
    def failure_exception(self) -> KVTransferError | None:
        """Why the room failed (None unless ``poll()`` is Failed)."""

    @abstractmethod
    def abort(self, reason: str = "") -> None:
        """Fails the room here and tells the decode side at once."""

    @abstractmethod
    def clear(self) -> None:
        """Forgets the room (aborting it first if it is not final)."""


class BaseKVReceiver(ABC):
    """Decode side of one room: tells prefill where to write, then watches it land."""

    @abstractmethod
    def init(self) -> None:
        """Starts resolving the prefill's layout (cached per bootstrap address)."""

    @abstractmethod
    def send_metadata(self, kv_page_indices: Sequence[int], aux_index: int,
                      decode_prefix_len: int = 0) -> None:
        """Pages for the whole prompt and the aux slot; the first ``decode_prefix_len`` tokens
        are already in those pages (decode's prefix cache) and are not sent."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """The room's state; never blocks."""

    @abstractmethod
    def failure_exception(self) -> KVTransferError | None:
        """Why the room failed (None unless ``poll()`` is Failed)."""

    @abstractmethod
    def abort(self, reason: str = "") -> None:
        """Fails the room here and tells the prefill side at once."""

    def no_write_can_land(self) -> bool:
        """True once no write for this room can land in its pages any more, so they may be reused:
        at once after Success or when no metadata went out; after a failure, once the prefill side
        acknowledged it stopped, is known gone, or its write-by deadline passed (Mooncake backend:
        write_fence.py). A backend that cannot tell says True once the room is final."""
        return self.poll() in (KVPoll.Success, KVPoll.Failed)

    @abstractmethod
    def clear(self) -> None:
        """Forgets the room (aborting it first if it is not final)."""
