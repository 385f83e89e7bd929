"""What a rank's KV memory looks like, as registered at the bootstrap server and sent in metadata.

The transfer layer sees KV memory as a list of registered buffers. Buffer ``i`` has a base
pointer and ``num_pages`` pages of ``page_bytes`` each: page ``p`` lives at
``ptr + p * page_bytes``. Every page holds ``[page_size, head_count, head_dim]`` elements of
``dtype`` (token-major, then head, then the head's elements). The engine's pool
``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` is ``2 * num_layers`` such
buffers (layer 0 K, layer 0 V, layer 1 K, ...): ``kv_buffers_from_pool`` builds them, and
``kv_buffers_from_views`` does the same for per-layer tensors.

The aux buffer is ``[num_slots, slot_bytes]`` bytes; one slot per request (see ``aux_data``).

Tensor parallelism: a rank holds the heads ``head_range(num_kv_heads, tp_size, tp_rank)``.
``head_sources`` says which prefill ranks a decode rank pulls each of its heads from when the
two sides have different TP sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.transfer.errors import LayoutMismatchError

DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "int32": 4, "float64": 8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype}")
    return name


@dataclass(frozen=True)
class KVBuffer:
    """One registered region: ``num_pages`` pages of ``page_bytes`` bytes from ``ptr``."""

    ptr: int
    page_bytes: int
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages


@dataclass(frozen=True)
class AuxBuffer:
    """The aux region: ``num_slots`` slots of ``slot_bytes`` bytes from ``ptr``."""

    ptr: int
    slot_bytes: int
    num_slots: int

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots


@dataclass(frozen=True)
class IpcRegion:
    """A device allocation a ``cuda_ipc`` rank exported: its base address and size in the exporting
    process, and its CUDA IPC handle (hex)."""

    base: int
    nbytes: int
    handle: str


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV memory and where to reach it.

    ``session`` (Mooncake ``host:rpc_port``), ``control_endpoint`` (ZeroMQ) and ``instance_id``
    (random per manager start) are filled in by the manager; the engine leaves them empty.
    ``ipc_regions``: the allocations a ``cuda_ipc`` rank exported (empty on Mooncake).
    """

    tp_size: int
    tp_rank: int
    head_start: int
    head_count: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    num_layers: int
    buffers: tuple[KVBuffer, ...]
    aux: AuxBuffer
    session: str = ""
    control_endpoint: str = ""
    instance_id: str = ""
    ipc_regions: tuple[IpcRegion, ...] = ()
    kv_scales: str = ""  # an FP8 cache's calibrated scales (engine/quantization/kv_fp8.scales_digest); "": none

    def __post_init__(self) -> None:
        self.validate()

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token (all of this rank's heads) in one buffer."""
        return self.head_count * self.head_bytes

    @property
    def num_pages(self) -> int:
        return self.buffers[0].num_pages if self.buffers else 0

    def validate(self) -> None:
        """Raises ``LayoutMismatchError`` when the fields contradict each other."""
        if self.dtype not in DTYPE_SIZES:
            raise LayoutMismatchError("dtype", sorted(DTYPE_SIZES), self.dtype)
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutMismatchError("tp_rank", f"0..{self.tp_size - 1}", self.tp_rank)
        if self.head_count < 1 or self.head_start < 0 or \
                self.head_start + self.head_count > self.num_kv_heads:
            raise LayoutMismatchError("head range", f"within 0..{self.num_kv_heads}",
                                      (self.head_start, self.head_count))
        expected = head_range(self.num_kv_heads, self.tp_size, self.tp_rank)
        if (self.head_start, self.head_count) != expected:
            raise LayoutMismatchError("head range", expected, (self.head_start, self.head_count),
                                      f"tp rank {self.tp_rank} of {self.tp_size}")
        page_bytes = self.page_size * self.token_bytes
        for i, buf in enumerate(self.buffers):
            if buf.page_bytes != page_bytes:
                raise LayoutMismatchError(f"buffers[{i}].page_bytes", page_bytes, buf.page_bytes)
            if buf.num_pages != self.buffers[0].num_pages:
                raise LayoutMismatchError(f"buffers[{i}].num_pages", self.buffers[0].num_pages,
                                          buf.num_pages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (bootstrap server, control messages)."""
        out = dataclasses.asdict(self)
        out["buffers"] = [[b.ptr, b.page_bytes, b.num_pages] for b in self.buffers]
        out["aux"] = [self.aux.ptr, self.aux.slot_bytes, self.aux.num_slots]
        if self.ipc_regions:
            out["ipc_regions"] = [[r.base, r.nbytes, r.handle] for r in self.ipc_regions]
        else:
            del out["ipc_regions"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of ``to_dict``; raises ``LayoutMismatchError``/``ValueError`` on bad input."""
        try:
            fields = {f.name for f in dataclasses.fields(cls)}
            values = {k: v for k, v in data.items() if k in fields}
            values["buffers"] = tuple(KVBuffer(int(p), int(b), int(n)) for p, b, n in data["buffers"])
            ptr, slot, num = data["aux"]
            values["aux"] = AuxBuffer(int(ptr), int(slot), int(num))
            values["ipc_regions"] = ipc_regions_from_list(data.get("ipc_regions", ()))
            for name in ("tp_size", "tp_rank", "head_start", "head_count", "num_kv_heads", "head_dim",
                         "page_size", "num_layers"):
                values[name] = int(values[name])
            for name in ("dtype", "session", "control_endpoint", "instance_id", "kv_scales"):
                values[name] = str(values.get(name, ""))
            return cls(**values)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV layout: {exc!r}") from exc

    def check_compatible(self, other: KVLayout, where: str = "") -> None:
        """Raises ``LayoutMismatchError`` unless pages of ``other`` can be copied into ours."""
        for name in ("num_kv_heads", "head_dim", "page_size", "dtype", "num_layers", "kv_scales"):
            if getattr(self, name) != getattr(other, name):
                raise LayoutMismatchError(name, getattr(self, name), getattr(other, name), where)
        if len(self.buffers) != len(other.buffers):
            raise LayoutMismatchError("number of buffers", len(self.buffers), len(other.buffers), where)


LAYOUT_DIGEST_VERSION = "v1"  # how layout_digest is computed; a digest of another version is refused


def layout_digest(data: dict[str, Any]) -> str:
    """``v1:`` and the SHA-256 of a layout's wire form (``to_dict``, keys sorted): names a decode rank's
    layout in its metadata, so the layout itself travels once per peer, not in every room's."""
    body = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return f"{LAYOUT_DIGEST_VERSION}:{hashlib.sha256(body).hexdigest()}"


def ipc_regions_from_list(items: Sequence[Sequence[Any]]) -> tuple[IpcRegion, ...]:
    """``[[base, nbytes, handle_hex], ...]`` (a layout's wire form) as regions; ``ValueError`` if malformed."""
    regions = []
    for item in items:
        base, nbytes, handle = item
        if not isinstance(handle, str):
            raise ValueError(f"IPC handle must be a hex string, got {type(handle).__name__}")
        bytes.fromhex(handle)
        regions.append(IpcRegion(int(base), int(nbytes), handle))
    return tuple(regions)


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first head, count) that ``tp_rank`` of ``tp_size`` holds.

    Heads split evenly when ``tp_size <= num_kv_heads``; with more ranks than heads each rank
    holds one replicated head (``tp_size`` must then be a multiple of ``num_kv_heads``).
    """
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over tp_size {tp_size}")
        count = num_kv_heads // tp_size
        return tp_rank * count, count
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {num_kv_heads} KV heads")
    return tp_rank * num_kv_heads // tp_size, 1


@dataclass(frozen=True)
class HeadSource:
    """Heads ``[head_start, head_start + head_count)`` come from prefill rank ``prefill_rank``."""

    prefill_rank: int
    head_start: int
    head_count: int


def head_sources(prefill_tp_size: int, num_kv_heads: int, head_start: int,
                 head_count: int) -> list[HeadSource]:
    """Which prefill ranks a decode rank holding ``[head_start, +head_count)`` pulls from.

    Each head comes from the lowest prefill rank holding it (with replication on the
    prefill side only one copy travels); neighbouring heads from one rank merge.
    """
    sources: list[HeadSource] = []
    for head in range(head_start, head_start + head_count):
        rank = next(r for r in range(prefill_tp_size)
                    if _holds(head_range(num_kv_heads, prefill_tp_size, r), head))
        if sources and sources[-1].prefill_rank == rank:
            last = sources[-1]
            sources[-1] = HeadSource(rank, last.head_start, last.head_count + 1)
        else:
            sources.append(HeadSource(rank, head, 1))
    return sources


def decode_ranks_per_prefill_rank(prefill_tp_size: int, decode_tp_size: int,
                                  num_kv_heads: int) -> list[int]:
    """How many decode ranks send metadata to each prefill rank for one room."""
    counts = [0] * prefill_tp_size
    for rank in range(decode_tp_size):
        start, count = head_range(num_kv_heads, decode_tp_size, rank)
        for src in {s.prefill_rank for s in head_sources(prefill_tp_size, num_kv_heads, start, count)}:
            counts[src] += 1
    return counts


def _holds(heads: tuple[int, int], head: int) -> bool:
    return heads[0] <= head < heads[0] + heads[1]


def kv_buffers_from_pool(pool: torch.Tensor) -> list[KVBuffer]:
    """Buffers of a contiguous pool ``[num_layers, 2, num_pages, page_size, heads, head_dim]``.

    Order: layer 0 K, layer 0 V, layer 1 K, ... (the order both sides must use).
    """
    if pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(f"KV pool must be [layers, 2, pages, page_size, heads, head_dim], got "
                         f"{tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("KV pool must be contiguous")
    return kv_buffers_from_views([pool[layer, kv] for layer in range(pool.shape[0]) for kv in range(2)])


def kv_buffers_from_views(views: Sequence[torch.Tensor]) -> list[KVBuffer]:
    """Buffers of per-(layer, K|V) tensors ``[num_pages, page_size, heads, head_dim]``."""
    out = []
    for i, view in enumerate(views):
        if view.dim() != 4 or not view.is_contiguous():
            raise ValueError(f"view {i} must be a contiguous [pages, page_size, heads, head_dim] tensor")
        page_bytes = view[0].numel() * view.element_size()
        out.append(KVBuffer(view.data_ptr(), page_bytes, view.shape[0]))
    return out


def aux_buffer_from_tensor(aux: torch.Tensor) -> AuxBuffer:
    """The aux region of a contiguous ``[num_slots, slot_bytes]`` uint8 tensor."""
    if aux.dim() != 2 or aux.dtype != torch.uint8 or not aux.is_contiguous():
        raise ValueError(f"aux must be a contiguous uint8 [slots, bytes] tensor, got {aux.dtype} "
                         f"{tuple(aux.shape)}")
    return AuxBuffer(aux.data_ptr(), aux.shape[1], aux.shape[0])


def layout_for_pool(pool: torch.Tensor, aux: torch.Tensor, *, tp_size: int = 1, tp_rank: int = 0,
                    num_kv_heads: int | None = None, kv_scales: str = "") -> KVLayout:
    """The layout of an engine's pool ``[layers, 2, pages, page_size, heads, head_dim]`` + aux.

    ``num_kv_heads`` is the model's total (defaults to this rank's heads times ``tp_size``); ``kv_scales``
    names an FP8 pool's calibrated scales (pages written with other scales would be read wrong).
    """
    layers, _, _, page_size, heads, head_dim = pool.shape
    total = num_kv_heads if num_kv_heads is not None else heads * tp_size
    start, count = head_range(total, tp_size, tp_rank)
    if count != heads:
        raise LayoutMismatchError("heads in pool", count, heads, f"tp rank {tp_rank} of {tp_size}")
    return KVLayout(
        tp_size=tp_size, tp_rank=tp_rank, head_start=start, head_count=count, num_kv_heads=total,
        head_dim=head_dim, page_size=page_size, dtype=dtype_name(pool.dtype), num_layers=layers,
        buffers=tuple(kv_buffers_from_pool(pool)), aux=aux_buffer_from_tensor(aux), kv_scales=kv_scales,
    )
