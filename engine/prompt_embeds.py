"""The input embeddings of a step whose prompt chunks cover image positions: the token embeddings,
with each image's rows written over its placeholder positions (only the part inside the chunk)."""

from __future__ import annotations

import torch

from splitserve.engine.image_items import ImageItem
from splitserve.engine.scheduler import ScheduledChunk


def image_spans(chunk: ScheduledChunk) -> list[tuple[ImageItem, int, int]]:
    """(image, first, end) prompt positions of each image inside the chunk's [start, start + length)."""
    lo, hi = chunk.start, chunk.start + chunk.length
    return [(item, max(item.offset, lo), min(item.end, hi))
            for item in chunk.request.images if item.offset < hi and item.end > lo]


def touches_images(chunks: list[ScheduledChunk]) -> bool:
    return any(image_spans(c) for c in chunks if c.request.images)


def missing_embeddings(chunks: list[ScheduledChunk]) -> list[ImageItem]:
    """Images this step needs whose rows are not computed yet (each once)."""
    seen: dict[int, ImageItem] = {}
    for c in chunks:
        for item, _, _ in image_spans(c):
            if item.embedding is None:
                seen.setdefault(id(item), item)
    return list(seen.values())


def scatter_image_rows(token_embeds: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """Writes the images' rows into the flat [T, hidden] token embeddings of the chunks, in place."""
    flat = 0
    for c in chunks:
        for item, first, end in image_spans(c):
            assert item.embedding is not None, "image rows must be computed or received before the step"
            rows = item.embedding[first - item.offset:end - item.offset]
            token_embeds[flat + first - c.start:flat + end - c.start] = rows.to(token_embeds)
        flat += c.length
    return token_embeds
