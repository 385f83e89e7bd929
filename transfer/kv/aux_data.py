"""The aux data that lands with a request's last chunk: first token, its logprob, cached tokens.

Packed little-endian as ``int32 first_token_id, float32 first_token_logprob, int32
cached_tokens`` (12 bytes) at the start of the request's aux slot; a slot may be larger.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

AUX_STRUCT = struct.Struct("<ifi")
AUX_BYTES = AUX_STRUCT.size


@dataclass(frozen=True)
class AuxData:
    """What decode needs besides the KV pages to continue a request."""

    first_token_id: int
    first_token_logprob: float
    cached_tokens: int


def make_aux_tensor(num_slots: int, slot_bytes: int = AUX_BYTES,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed ``[num_slots, slot_bytes]`` uint8 tensor to register as the aux buffer (on the GPU
    for the ``cuda_ipc`` backend, which copies device memory only: see ``kv_backend.aux_device``)."""
    if slot_bytes < AUX_BYTES:
        raise ValueError(f"aux slots need at least {AUX_BYTES} bytes, got {slot_bytes}")
    return torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, device=device)


def pack_aux(aux: torch.Tensor, slot: int, data: AuxData) -> None:
    """Writes ``data`` into slot ``slot`` of the aux tensor (from pageable memory: on a GPU tensor a blocking
    copy, which waits for the stream's queued work; an engine writes through ``AuxWriter``)."""
    raw = AUX_STRUCT.pack(data.first_token_id, data.first_token_logprob, data.cached_tokens)
    aux[slot, :AUX_BYTES] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class AuxWriter:
    """Writes requests' aux data into an aux tensor without waiting for the device.

    In device memory (``cuda_ipc``), the slot goes through a pinned host copy of the slots as an asynchronous
    copy on the transfer's copy stream (``stream``; None: the current stream): ``pack_aux``'s copy from
    pageable memory first waits for everything queued on the stream, so every finishing request held the engine
    thread until the forward pass in flight ended. In stream order the slot lands before the transfer's copy
    kernel, launched later on the same stream, reads it.
    A slot's host row is rewritten only by that slot's next write (a later request's), whose own copy is
    queued after the earlier one. In host memory it is ``pack_aux``."""

    def __init__(self, aux: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        self.aux = aux
        self.stream = stream  # the transfer's copy stream where it has one (``KVManager.copy_stream``)
        self._host: torch.Tensor | None = None
        if aux.device.type == "cuda":
            self._host = torch.zeros(aux.shape, dtype=torch.uint8).pin_memory()
            self._rows = self._host.numpy()

    def write(self, slot: int, data: AuxData) -> None:
        """Writes ``data`` into slot ``slot`` (queued on ``stream`` where the slots are on a GPU)."""
        if self._host is None:
            pack_aux(self.aux, slot, data)
            return
        if not 0 <= slot < len(self._rows):
            raise IndexError(f"aux slot {slot} outside 0..{len(self._rows) - 1}")
        AUX_STRUCT.pack_into(self._rows[slot], 0, data.first_token_id, data.first_token_logprob, data.cached_tokens)
        with torch.cuda.stream(self.stream):  # (None: the current stream)
            self.aux[slot, :AUX_BYTES].copy_(self._host[slot, :AUX_BYTES], non_blocking=True)


class AuxReader:
    """Reads requests' aux data from an aux tensor without waiting for the engine's queued work.

    In device memory (``cuda_ipc``), ``unpack_aux``'s ``.cpu()`` is a copy on the current stream, which first waits
    for everything queued there: the decode's engine thread stalled behind the forward pass in flight once per
    request whose KV arrived. The slot was written by the prefill's copy, which had landed before its Success was
    sent, so nothing on this process's streams writes it: the read goes on a stream of its own that does not
    synchronise with the default one (into a pinned row), and waits for that copy alone."""

    def __init__(self, aux: torch.Tensor) -> None:
        self.aux = aux
        self._stream: torch.cuda.Stream | None = None
        if aux.device.type == "cuda":
            self._stream = torch.cuda.Stream(aux.device)  # torch's streams never wait for the legacy default one
            self._row = torch.zeros(AUX_BYTES, dtype=torch.uint8).pin_memory()

    def read(self, slot: int) -> AuxData:
        """The aux data in slot ``slot``."""
        if self._stream is None:
            return unpack_aux(self.aux, slot)
        if not 0 <= slot < self.aux.shape[0]:
            raise IndexError(f"aux slot {slot} outside 0..{self.aux.shape[0] - 1}")
        with torch.cuda.stream(self._stream):
            self._row.copy_(self.aux[slot, :AUX_BYTES], non_blocking=True)
        self._stream.synchronize()
        return AuxData(*AUX_STRUCT.unpack(self._row.numpy().tobytes()))


def unpack_aux(aux: torch.Tensor, slot: int) -> AuxData:
    """Reads slot ``slot`` of the aux tensor."""
    raw = bytes(aux[slot, :AUX_BYTES].cpu().numpy().tobytes())
    token, logprob, cached = AUX_STRUCT.unpack(raw)
    return AuxData(token, logprob, cached)
