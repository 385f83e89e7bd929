"""Multimodal rotary positions (Qwen2-VL's M-RoPE): every prompt token has three positions (t, h, w).

A text token has all three equal, counting on from the previous token's largest position. An image's
tokens (one per merged block of patches, row by row) take (s, s + row, s + column) where s is the position
the image starts at, and the text after it continues from s + max(rows, columns). So past the last image a
token's positions are its index plus a fixed `delta` (<= 0: an image is narrower in positions than in
tokens), which is how decode steps, and any token past the last image, get theirs without the table.
With all three positions equal, M-RoPE is the plain RoPE of that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitserve.engine.request import Request
    from splitserve.engine.scheduler import ScheduledChunk


def mrope_positions(length: int, images: Sequence[tuple[int, tuple[int, int, int]]], merge_size: int
                    ) -> tuple[torch.Tensor, int]:
    """([3, end] int64 positions of tokens 0..end, delta): `end` is the last image's end (0 without images;
    every token from there on sits at its index + delta). `images`: (offset, (t, h, w) patch grid) each."""
    pieces: list[torch.Tensor] = []
    pos = cursor = 0  # the next text token's position; the next token's index
    for offset, (t, h, w) in sorted(images):
        if offset < cursor:
            raise ValueError(f"image at token {offset} overlaps the one before it (ends at {cursor})")
        if offset > cursor:
            pieces.append(torch.arange(pos, pos + offset - cursor).expand(3, -1))
            pos += offset - cursor
        rows, cols = h // merge_size, w // merge_size
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols),
                                                indexing="ij")
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + pos)
        cursor = offset + t * rows * cols
        pos += max(rows, cols)
    if cursor > length:
        raise ValueError(f"images end at token {cursor}, past the prompt's {length}")
    table = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    return table.long(), pos - cursor


def chunk_rope_positions(table: torch.Tensor, delta: int, start: int, length: int) -> torch.Tensor:
    """[3, length] positions of tokens start..start+length: the table's where it covers them, index + delta past it."""
    end = start + length
    covered = table[:, start:min(end, table.shape[1])]
    rest = torch.arange(min(max(start, table.shape[1]), end), end) + delta
    return torch.cat([covered, rest.expand(3, -1)], dim=1)


def request_mrope(request: Request, merge_size: int) -> tuple[torch.Tensor, int]:
    """The request's table and delta, from its images' offsets and grids (kept on the request)."""
    if request.mrope is None:
        images = []
        for item in request.images:
            if item.grid is None:
                raise ValueError(f"image {item.digest[:12]} of request {request.request_id} has no patch grid")
            images.append((item.offset, item.grid))
        request.mrope = mrope_positions(len(request.prompt_ids), images, merge_size)
    return request.mrope


def decode_rope_offsets(chunks: list[ScheduledChunk], merge_size: int) -> list[int]:
    """Each one-token chunk's M-RoPE offset (rotary position minus KV position): the request's delta past its
    last image, 0 for text-only requests. A text token's three positions are equal, so it rotates as plain
    RoPE at position + offset (a decode graph's input row); image tokens never take this path."""
    offsets = []
    for c in chunks:
        if not c.request.images:
            offsets.append(0)
            continue
        table, delta = request_mrope(c.request, merge_size)
        if c.start >= table.shape[1]:  # past the last image: every decode step
            offsets.append(delta)
            continue
        t, h, w = (int(x) for x in table[:, c.start])  # a one-token prompt chunk between images
        assert t == h == w, "an image token is never a decode row"
        offsets.append(t - c.start)
    return offsets


def batch_rope_positions(chunks: list[ScheduledChunk], merge_size: int) -> torch.Tensor | None:
    """[3, T] rotary positions of a step's flattened tokens, or None when no request has images (then every
    token's three positions are its index: plain RoPE, the graphs' and fused kernels' path)."""
    if not any(c.request.images for c in chunks):
        return None
    parts = []
    for c in chunks:
        if c.request.images:
            table, delta = request_mrope(c.request, merge_size)
            parts.append(chunk_rope_positions(table, delta, c.start, c.length))
        else:
            parts.append(torch.arange(c.start, c.start + c.length).expand(3, -1))
    return torch.cat(parts, dim=1)
