"""The token-to-KV pool: every layer's keys and values in one paged, contiguous tensor.

Layout [layers, 2 (k, v), pages, page_size, kv_heads, head_dim]: one page of one layer's keys
is one contiguous run of bytes, which is what the transfer layer moves and registers.
Page 0 is scratch: the allocator never hands it out, so padded rows (CUDA-graph buckets,
batched gathers) can read and write it without touching a request's KV.
An FP8 pool (`--kv-cache-dtype fp8_e4m3`) holds e4m3 pages and a float32 scale per layer, K or V and KV head
(engine/quantization/kv_fp8.py); a page is then half the bytes of a 16-bit one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.quantization.kv_fp8 import KVScales

SCRATCH_PAGE = 0
COPY_PAGE_OP = "copy_kv_page"  # the tensor-parallel op that repeats `copy_page` on a worker's pool


@dataclass(frozen=True)
class KVPoolShape:
    """How big the pool is and how a page is laid out."""

    num_layers: int
    num_pages: int  # including the scratch page
    page_size: int
    num_kv_heads: int  # this rank's heads
    head_dim: int
    dtype: torch.dtype  # what the pages hold: the model's dtype, or float8_e4m3fn

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's keys (or values)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * 2 * self.num_layers * self.num_pages

    @staticmethod
    def bytes_per_page_all_layers(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                                  dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


def page_bytes_view(buffer: torch.Tensor) -> torch.Tensor:
    """The pool's buffer as the tiers copy it: an FP8 pool's as uint8 of the same shape (its pages move as their
    bytes; torch's index_select and index_copy_ take no float8), any other as it is."""
    return buffer.view(torch.uint8) if buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else buffer


def page_index(pages: list[int], device: torch.device) -> torch.Tensor:
    """`pages` as an int64 index on `device`, copied from pinned memory without waiting: a copy from pageable
    memory waits for its stream, and a tier's side stream waits for the compute stream's queued step, so the
    engine's loop would stall until that step completed."""
    return torch.tensor(pages, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


class KVPool:
    """Owns the KV tensor; hands each attention layer flat [tokens, heads, dim] views."""

    def __init__(self, shape: KVPoolShape, device: torch.device) -> None:
        self.shape = shape
        self.buffer = torch.zeros(
            shape.num_layers, 2, shape.num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim,
            dtype=shape.dtype, device=device,
        )
        tokens = shape.num_pages * shape.page_size
        self._k = [self.buffer[i, 0].view(tokens, shape.num_kv_heads, shape.head_dim)
                   for i in range(shape.num_layers)]
        self._v = [self.buffer[i, 1].view(tokens, shape.num_kv_heads, shape.head_dim)
                   for i in range(shape.num_layers)]
        # [layers, 2 (k, v), kv_heads] float32: static, 1.0 unless set (set_scales) before any page is written.
        self.scales = (torch.ones(shape.num_layers, 2, shape.num_kv_heads, dtype=torch.float32, device=device)
                       if shape.fp8 else None)
        self.e4m3_prompts = False  # an FP8 pool's prompts attend in e4m3 where cuDNN would run (the runner decides)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def layer_scales(self, layer: int) -> KVScales | None:
        """The layer's key and value scales of an FP8 pool; None: the pages hold the model's dtype."""
        if self.scales is None:
            return None
        return KVScales(self.scales[layer, 0], self.scales[layer, 1], self.e4m3_prompts)

    def set_scales(self, scales: torch.Tensor) -> None:
        """Sets the scales ([layers, 2, kv_heads], each > 0) in place: the kernels captured in CUDA graphs keep
        reading the same tensor."""
        if self.scales is None:
            raise ValueError("KV scales set on a pool that is not FP8")
        if scales.shape != self.scales.shape or not bool((scales > 0).all()):
            raise ValueError(f"KV scales must be positive, of shape {tuple(self.scales.shape)}, got "
                             f"{tuple(scales.shape)}")
        self.scales.copy_(scales)

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page `src` of every layer's keys and values into page `dst` (queued on the device
        in order with the forward passes, so a later step reads it written)."""
        self.buffer[:, :, dst].copy_(self.buffer[:, :, src])
