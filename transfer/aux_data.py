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
    """Writes ``data`` into slot ``slot`` of the aux tensor."""
    raw = AUX_STRUCT.pack(data.first_token_id, data.first_token_logprob, data.cached_tokens)
    aux[slot, :AUX_BYTES] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_aux(aux: torch.Tensor, slot: int) -> AuxData:
    """Reads slot ``slot`` of the aux tensor."""
    raw = bytes(aux[slot, :AUX_BYTES].cpu().numpy().tobytes())
    token, logprob, cached = AUX_STRUCT.unpack(raw)
    return AuxData(token, logprob, cached)
