"""Exceptions of the transfer layer, each carrying the values that explain it.

A room's failure is kept as one of the ``KVTransferError`` subclasses and handed to the
engine by ``failure_exception()``; the engine turns it into the client's error message.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by ``splitserve.transfer``."""


class TransferEngineUnavailableError(TransferError):
    """The Mooncake transfer engine cannot be imported or initialised."""


class RdmaUnavailableError(TransferEngineUnavailableError):
    """Protocol ``rdma`` was asked for but this machine has no (or not the named) RDMA device."""

    def __init__(self, wanted: str, found: list[str]) -> None:
        self.wanted = wanted
        self.found = found
        found_text = ", ".join(found) if found else "none"
        super().__init__(
            f"transfer protocol 'rdma' asked for (devices {wanted or 'any'}) but the RDMA devices "
            f"found under /sys/class/infiniband are: {found_text}; use --transfer-protocol tcp "
            "on a machine without RDMA (there is no silent fallback)"
        )


class CudaIpcUnavailableError(TransferEngineUnavailableError):
    """Protocol ``cuda_ipc`` was asked for where it cannot run (no CUDA device, KV not in device memory)."""


class CudaIpcError(TransferError):
    """A CUDA IPC copy cannot be done: unknown peer session, or an address outside what the peer exported."""


class MooncakeCallError(TransferError):
    """A Mooncake call returned a non-zero status (Mooncake never raises: every int is checked)."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.detail = detail
        super().__init__(f"mooncake {call} returned {code}" + (f": {detail}" if detail else ""))


class LayoutMismatchError(TransferError):
    """Two KV layouts that must agree (prefill and decode, or two ranks of one replica) do not."""

    def __init__(self, field: str, expected: object, actual: object, where: str = "") -> None:
        self.field = field
        self.expected = expected
        self.actual = actual
        self.where = where
        super().__init__(
            f"KV layout mismatch{f' ({where})' if where else ''}: {field} expected {expected!r}, "
            f"got {actual!r}"
        )


class ControlMessageError(TransferError):
    """A control message could not be decoded or failed validation (it is dropped)."""


class BootstrapError(TransferError):
    """The bootstrap server could not be reached, refused a registration, or answered garbage."""


class RoomInUseError(TransferError):
    """A sender or receiver already exists for this room on this manager."""

    def __init__(self, room: int, bootstrap_addr: str = "") -> None:
        self.room = room
        self.bootstrap_addr = bootstrap_addr
        super().__init__(f"room {room} ({bootstrap_addr or 'local'}) already has a transfer")


class TransferUsageError(TransferError):
    """The engine called the sender/receiver API out of order or with bad arguments."""


class KVTransferError(TransferError):
    """Why one room failed. ``room`` is the bootstrap room."""

    def __init__(self, room: int, message: str) -> None:
        self.room = room
        super().__init__(f"room {room}: {message}")


class KVTimeoutError(KVTransferError):
    """A room stayed too long in one non-final state."""

    def __init__(self, room: int, state: str, timeout_s: float) -> None:
        self.state = state
        self.timeout_s = timeout_s
        super().__init__(room, f"timed out after {timeout_s:g}s in state {state}")


class KVWriteDeadlineError(KVTransferError):
    """The decode's write-by deadline passed before a write could start: nothing more is written."""

    def __init__(self, room: int, late_s: float) -> None:
        self.late_s = late_s
        super().__init__(room, f"the decode's write-by deadline passed {late_s:.1f}s ago: nothing more is written")


class KVPeerLostError(KVTransferError):
    """The peer of a room stopped answering heartbeats or restarted."""

    def __init__(self, room: int, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(room, f"peer {peer} lost: {reason}")


class KVAbortedError(KVTransferError):
    """The room was aborted, locally or by the peer."""

    def __init__(self, room: int, by: str, reason: str = "") -> None:
        self.by = by
        self.reason = reason
        super().__init__(room, f"aborted by {by}" + (f": {reason}" if reason else ""))


class KVLengthMismatchError(KVTransferError):
    """The two sides disagree on a length (pages, tokens, slots)."""

    def __init__(self, room: int, what: str, expected: int, actual: int) -> None:
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(room, f"{what}: expected {expected}, got {actual}")


class KVMetadataError(KVTransferError):
    """The peer's metadata or layout cannot be used for this room."""

    def __init__(self, room: int, reason: str) -> None:
        self.reason = reason
        super().__init__(room, f"bad metadata: {reason}")


class KVWriteError(KVTransferError):
    """Mooncake failed to write a room's pages to the peer."""

    def __init__(self, room: int, peer: str, code: int, nbytes: int) -> None:
        self.peer = peer
        self.code = code
        self.nbytes = nbytes
        super().__init__(room, f"writing {nbytes} bytes to {peer} failed (mooncake status {code})")


class KVPeerFailedError(KVTransferError):
    """The peer reported this room as failed; ``reason`` is its explanation."""

    def __init__(self, room: int, peer: str, reason: str) -> None:
        self.peer = peer
        self.reason = reason
        super().__init__(room, f"peer {peer} failed the room: {reason}")


class KVWorkerError(KVTransferError):
    """The worker writing this room's pages raised (a bug or an unexpected Mooncake failure)."""

    def __init__(self, room: int, peer: str, error: Exception) -> None:
        self.peer = peer
        self.error = error
        super().__init__(room, f"the transfer worker for {peer} failed: {error!r}")
