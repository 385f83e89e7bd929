"""``CudaIpcEngine``: KV writes between processes on one host's GPUs, through CUDA IPC.

The same surface as ``MooncakeEngine`` (``register``, ``write``, ``session_id``, ``close``), so
the rooms, control channel and bootstrap protocol stay the Mooncake backend's. What differs:

- ``register`` finds the device allocation holding each buffer and takes one IPC handle per
  allocation (the engine's pool is one allocation; the aux tensor another); ``regions`` lists
  them, and the manager publishes them in this rank's layout;
- a peer's regions are learnt from its layout (``learn_peer``, from the decode's metadata) and
  opened the first time something is written to that peer (the "handshake"), once per peer;
- ``write`` translates the peer's addresses to the mapped ones, checks every segment lies in
  memory the two sides registered / exported, copies all segments with one kernel launch
  (segment_copy.py) on the copy stream (see below) and returns once the copy finished:
  like Mooncake's synchronous write, Success is reported only after the bytes are in place;
- ``write_pages`` does the same for whole pages given as runs (``PageRuns``): the two layouts' buffer
  bases are checked and translated once per layout, each write checks only that its runs lie inside
  a buffer, and the kernel expands runs x buffers on the device; ``launch_pages`` returns once the copy
  is queued, with the call that waits for it (a worker prepares the next rooms meanwhile). Unmapping a
  peer first waits for its copies still in flight.

Ordering with the engine, two ways:

- ``own_stream=True`` (an engine's transfers): copies run on a stream of their own, which waits for nothing
  the engine queued on its stream. The engine ships only KV it has seen computed (a chunk's pages go once the
  host has read that step's tokens, so the step is finished on the device), and the aux slot a copy reads is
  written on this same stream (``copy_stream``, given to ``AuxWriter``). A copy then starts at once, beside
  the engine's next step, instead of after it.
- ``own_stream=False``: writes run on the worker thread's current stream, the legacy default stream, which
  the engine's forward passes and CUDA-graph replays also use: a copy enqueued after a chunk's forward was
  enqueued runs after it, so it reads the chunk's finished KV, and after whatever step was queued before it.

A peer in this same process (tests, benchmarks) needs no mapping: CUDA refuses to open one's
own handle, and the addresses are valid as they are.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitserve.transfer.cuda_ipc.cuda_driver import CudaDriver, CudaDriverError
from splitserve.transfer.cuda_ipc.segment_copy import PendingCopy, SegmentCopier
from splitserve.transfer.errors import CudaIpcError, CudaIpcUnavailableError
from splitserve.transfer.kv.layout import IpcRegion, KVLayout
from splitserve.transfer.kv.plan import PageRuns, buffer_bases

log = logging.getLogger(__name__)

SESSION_PREFIX = "cuda_ipc"


def session_name(host: str, pid: int, token: str) -> str:
    return f"{SESSION_PREFIX}:{host}:{pid}:{token}"


def session_process(session: str) -> tuple[str, int]:
    """(host, pid) of a ``cuda_ipc`` session name."""
    parts = session.split(":")
    if len(parts) != 4 or parts[0] != SESSION_PREFIX:
        raise CudaIpcError(f"{session!r} is not a cuda_ipc session (the peer runs another transfer protocol?)")
    return parts[1], int(parts[2])


def translate(addrs: np.ndarray, lens: np.ndarray, bases: np.ndarray, sizes: np.ndarray,
              local_bases: np.ndarray, what: str) -> np.ndarray:
    """Addresses inside the regions ``[bases, bases + sizes)`` moved to ``local_bases``; raises
    ``CudaIpcError`` if any segment ``[addr, addr + len)`` is not inside one region.

    Usually one region (the KV pool) holds every segment of a write: then the lowest start and the
    highest end prove it, and one shift moves them all (a merged write has ~2,000 segments per room;
    a region lookup per segment cost more than planning the rest of the write)."""
    if len(addrs) and (lens >= 0).all():
        lo, hi = int(addrs.min()), int((addrs + lens).max())
        inside = (bases <= lo) & (hi <= bases + sizes)
        if inside.any():
            i = int(np.flatnonzero(inside)[0])
            return addrs + (int(local_bases[i]) - int(bases[i]))
    order = np.argsort(bases)
    bases, sizes, local_bases = bases[order], sizes[order], local_bases[order]
    idx = np.searchsorted(bases, addrs, side="right") - 1
    inside = (idx >= 0) & (addrs + lens <= bases[np.maximum(idx, 0)] + sizes[np.maximum(idx, 0)])
    if not inside.all():
        bad = int(np.flatnonzero(~inside)[0])
        raise CudaIpcError(f"{what} segment [{int(addrs[bad]):#x}, +{int(lens[bad])}) is outside the "
                           f"{len(bases)} registered region(s)")
    return addrs - bases[idx] + local_bases[idx]


def check_runs(runs: PageRuns, src_extent: int, dst_extent: int) -> None:
    """Raises ``CudaIpcError`` unless every run lies inside a buffer of ``src_extent`` bytes on our side and
    of ``dst_extent`` on the peer's (then, with the buffers inside the exported regions, so does every
    segment the kernel expands them to)."""
    if not len(runs.lens):
        return
    if min(int(runs.src_offs.min()), int(runs.dst_offs.min()), int(runs.lens.min())) < 0:
        raise CudaIpcError("a page run starts before its buffer or has a negative length")
    for offs, extent, what in ((runs.src_offs, src_extent, "source"), (runs.dst_offs, dst_extent, "destination")):
        if int((offs + runs.lens).max()) > extent:
            raise CudaIpcError(f"a {what} page run ends past its buffer ({extent} bytes)")


@dataclass
class _PeerMapping:
    """A peer's regions and, once opened, where they are mapped here."""

    regions: tuple[IpcRegion, ...]
    same_process: bool
    local_bases: np.ndarray | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    bases: np.ndarray = field(init=False)
    sizes: np.ndarray = field(init=False)
    # id(layout) -> (layout, its buffers' bases mapped here, its smallest buffer's bytes): checked once
    buffers: dict[int, tuple[KVLayout, np.ndarray, int]] = field(default_factory=dict)
    in_flight: list[PendingCopy] = field(default_factory=list)  # launched into this mapping, not yet waited for

    def __post_init__(self) -> None:
        self.bases = np.array([r.base for r in self.regions], dtype=np.int64)
        self.sizes = np.array([r.nbytes for r in self.regions], dtype=np.int64)


class CudaIpcEngine:
    """CUDA IPC transport of one engine rank (on the calling thread's current CUDA device); its copies on
    ``copy_stream`` where ``own_stream`` (see the module docstring), else on the writing thread's stream."""

    def __init__(self, host: str, own_stream: bool = False) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise CudaIpcUnavailableError(f"transfer protocol 'cuda_ipc' needs torch: {exc}") from exc
        if not torch.cuda.is_available():
            raise CudaIpcUnavailableError(
                "transfer protocol 'cuda_ipc' needs a CUDA device, and this process sees none "
                "(torch.cuda.is_available() is False); use --transfer-protocol tcp or rdma")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.driver = CudaDriver(self.device.index)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.protocol = "cuda_ipc"
        self.session_id = session_name(self.host, self.pid, secrets.token_hex(4))
        self._own: dict[int, IpcRegion] = {}
        self._own_arrays = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # bases, sizes: checked every write
        self._known: dict[str, tuple[IpcRegion, ...]] = {}
        self._own_buffers: dict[int, tuple[KVLayout, np.ndarray, int]] = {}  # as _PeerMapping.buffers
        self._peers: dict[str, _PeerMapping] = {}
        self._lock = threading.Lock()
        self._closed = False
        # torch's streams are made non-blocking: they never wait for the legacy default stream's work.
        self.copy_stream = torch.cuda.Stream(self.device) if own_stream else None
        if own_stream:
            # What was allocated under other streams until now (the pool, the aux slots) is idle from here on:
            # no step still queued there uses a block the copies will read or write.
            torch.cuda.synchronize(self.device)
        self.copier = SegmentCopier(self.device, stream=self.copy_stream)

    # ------------------------------------------------------------ own memory

    def register(self, ptr: int, length: int) -> None:
        """Exports the allocation holding ``[ptr, ptr + length)`` (once per allocation)."""
        try:
            base, size = self.driver.allocation_of(ptr)
        except CudaDriverError as exc:
            raise CudaIpcUnavailableError(f"transfer protocol 'cuda_ipc' needs the KV pool and the aux slots in "
                                          f"CUDA device memory: {exc}") from exc
        if ptr + length > base + size:
            raise CudaIpcUnavailableError(f"[{ptr:#x}, +{length}) spans more than one CUDA allocation")
        with self._lock:
            if base in self._own:
                return
        handle = self.driver.ipc_handle(base)
        with self._lock:
            self._own[base] = IpcRegion(base, size, handle.hex())
            self._own_arrays = (np.array(sorted(self._own), dtype=np.int64),
                                np.array([self._own[b].nbytes for b in sorted(self._own)], dtype=np.int64))

    @property
    def regions(self) -> tuple[IpcRegion, ...]:
        """The allocations this rank exported, for its layout."""
        with self._lock:
            return tuple(self._own[b] for b in sorted(self._own))

    # ------------------------------------------------------------------ peers

    def learn_peer(self, session: str, regions: Sequence[IpcRegion]) -> None:
        """Remembers a peer's regions (from its layout); opened on the first write. Cheap when known."""
        with self._lock:
            if session not in self._known and not self._closed:
                self._known[session] = tuple(regions)

    def forget(self, session: str) -> None:
        """Unmaps a peer (gone or restarted); waits for a write to it in flight."""
        with self._lock:
            self._known.pop(session, None)
            mapping = self._peers.pop(session, None)
        if mapping is not None:
            self._unmap(session, mapping)

    @property
    def mapped_peers(self) -> int:
        """Peers whose regions are mapped here now (tests check it returns to zero)."""
        with self._lock:
            return sum(1 for m in self._peers.values() if m.local_bases is not None and not m.same_process)

    def _mapping(self, session: str) -> _PeerMapping:
        with self._lock:
            if self._closed:
                raise CudaIpcError("cuda_ipc engine is closed")
            mapping = self._peers.get(session)
            if mapping is None:
                regions = self._known.get(session)
                if regions is None:
                    raise CudaIpcError(f"no exported memory known for peer session {session!r}")
                host, pid = session_process(session)
                mapping = self._peers[session] = _PeerMapping(regions, host == self.host and pid == self.pid)
        return mapping

    def _open_locked(self, session: str, mapping: _PeerMapping) -> np.ndarray:
        if mapping.local_bases is None:
            if mapping.same_process:
                mapping.local_bases = mapping.bases
            else:
                opened: list[int] = []
                try:
                    for region in mapping.regions:
                        opened.append(self.driver.open_ipc_handle(bytes.fromhex(region.handle)))
                except Exception:
                    for ptr in opened:
                        self.driver.close_ipc_handle(ptr)
                    with self._lock:  # the next room tries again
                        if self._peers.get(session) is mapping:
                            del self._peers[session]
                    raise
                mapping.local_bases = np.array(opened, dtype=np.int64)
                log.info("cuda_ipc: mapped %d region(s) of %s", len(opened), session)
        return mapping.local_bases

    def _unmap(self, session: str, mapping: _PeerMapping) -> None:
        with mapping.lock:
            mapping.closed = True
            for pending in mapping.in_flight:  # its worker may not wait for it soon: no unmapping under a copy
                pending.done.synchronize()
            if mapping.local_bases is not None and not mapping.same_process:
                for ptr in mapping.local_bases.tolist():
                    try:
                        self.driver.close_ipc_handle(int(ptr))
                    except Exception as exc:
                        log.warning("cuda_ipc: unmapping a region of %s failed: %s", session, exc)
            mapping.local_bases = None

    # ------------------------------------------------------------------ write

    takes_arrays = True  # write() takes the plan's numpy arrays as they are (no lists of ints)
    merges_writes = True  # queued rooms to one peer share a write: one launch and one wait (peer_workers.py)
    quick_writes = True  # a write is a local copy of milliseconds: a last chunk needs no Transferring notice first

    def write(self, session: str, srcs: Sequence[int] | np.ndarray, dsts: Sequence[int] | np.ndarray,
              lens: Sequence[int] | np.ndarray) -> int:
        """Copies local ``srcs`` to the peer's ``dsts`` (its addresses); returns 0 once they landed.

        Raises ``CudaIpcError`` / ``CudaDriverError`` (the room fails with the reason)."""
        src = np.asarray(srcs, dtype=np.int64)
        dst = np.asarray(dsts, dtype=np.int64)
        length = np.asarray(lens, dtype=np.int64)
        mapping = self._mapping(session)
        with mapping.lock:
            if mapping.closed:
                raise CudaIpcError(f"peer session {session!r} was unmapped (peer lost or restarted)")
            local_bases = self._open_locked(session, mapping)
            if len(length) == 0:
                return 0
            peer_dst = translate(dst, length, mapping.bases, mapping.sizes, local_bases,
                                 f"destination (peer {session})")
            own_bases, own_sizes = self._own_arrays
            translate(src, length, own_bases, own_sizes, own_bases, "source")
            self.copier.copy(src, peer_dst, length)
        return 0

    def write_pages(self, session: str, runs: PageRuns) -> int:
        """Copies whole pages (``runs``: our layout's pages into the peer's) and their aux segments; returns 0
        once they landed. Raises as ``write``."""
        return self.launch_pages(session, runs)()

    def launch_pages(self, session: str, runs: PageRuns) -> Callable[[], int]:
        """``write_pages`` up to the launch: returns once the copy is queued, with the call that returns 0 once
        it landed (call it, from any thread; until then a write to this peer is in flight). The host checks
        that every run lies inside a buffer and each layout's buffers inside what the two sides exported
        (once per layout); the kernel expands runs x buffers. Raises as ``write``."""
        mapping = self._mapping(session)
        with mapping.lock:
            if mapping.closed:
                raise CudaIpcError(f"peer session {session!r} was unmapped (peer lost or restarted)")
            local_bases = self._open_locked(session, mapping)
            src_bases, src_extent = self._buffers(self._own_buffers, runs.src, *self._own_arrays, self._own_arrays[0],
                                                  "source")
            dst_bases, dst_extent = self._buffers(mapping.buffers, runs.dst, mapping.bases, mapping.sizes, local_bases,
                                                  f"destination (peer {session})")
            check_runs(runs, src_extent, dst_extent)
            aux = runs.aux
            aux_dsts = translate(aux.dsts, aux.lens, mapping.bases, mapping.sizes, local_bases,
                                 f"destination (peer {session})")
            own_bases, own_sizes = self._own_arrays
            translate(aux.srcs, aux.lens, own_bases, own_sizes, own_bases, "source")
            try:
                pending = self.copier.launch_runs(src_bases, dst_bases, runs.src_offs, runs.dst_offs, runs.lens,
                                                  (aux.srcs, aux_dsts, aux.lens))
            except ValueError:  # not in 8-byte words (no KV pool of ours): one segment per run and buffer
                segments = runs.segments()
                peer_dst = translate(segments.dsts, segments.lens, mapping.bases, mapping.sizes, local_bases,
                                     f"destination (peer {session})")
                self.copier.copy(segments.srcs, peer_dst, segments.lens)
                pending = None
            if pending is not None:
                mapping.in_flight.append(pending)

        def landed() -> int:
            if pending is not None:
                self.copier.finish(pending)
                with mapping.lock:
                    if pending in mapping.in_flight:
                        mapping.in_flight.remove(pending)
            return 0

        return landed

    @staticmethod
    def _buffers(cache: dict[int, tuple[KVLayout, np.ndarray, int]], layout: KVLayout, bases: np.ndarray,
                 sizes: np.ndarray, local_bases: np.ndarray, what: str) -> tuple[np.ndarray, int]:
        """``layout``'s buffer bases translated to where they are mapped here, and the bytes every buffer holds
        at least; each buffer checked to lie inside an exported region, once per layout."""
        hit = cache.get(id(layout))
        if hit is None or hit[0] is not layout:
            extent = min((b.nbytes for b in layout.buffers), default=0)
            mapped = translate(buffer_bases(layout), np.full(len(layout.buffers), extent, dtype=np.int64), bases,
                               sizes, local_bases, what)
            if len(cache) >= 64:
                cache.clear()
            hit = cache[id(layout)] = (layout, mapped, extent)
        return hit[1], hit[2]

    def mapped_destinations(self, session: str, dsts: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Where a mapped peer's addresses are in this process (benchmarks time the copy kernel on them)."""
        mapping = self._mapping(session)
        with mapping.lock:
            local_bases = self._open_locked(session, mapping)
            return translate(np.asarray(dsts, dtype=np.int64), np.asarray(lens, dtype=np.int64), mapping.bases,
                             mapping.sizes, local_bases, "destination")

    def close(self) -> None:
        """Unmaps every peer. Idempotent."""
        with self._lock:
            self._closed = True
            peers, self._peers = self._peers, {}
            self._known.clear()
        for session, mapping in peers.items():
            self._unmap(session, mapping)
