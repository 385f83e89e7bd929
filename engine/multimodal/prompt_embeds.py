"""The image rows of a step whose prompt chunks cover image positions, and where they go: each
image's rows (only the part inside the chunk) and the flat token positions of its placeholders.
The model writes them over the token embeddings (layers/embedding.py's `with_image_rows`)."""

from __future__ import annotations

import torch

from splitserve.engine.multimodal.image_items import ImageItem
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


def image_rows(chunks: list[ScheduledChunk], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' image rows [N, hidden] and the flat token positions [N] they replace."""
    rows, positions = [], []
    flat = 0
    for c in chunks:
        for item, first, end in image_spans(c):
            assert item.embedding is not None, "image rows must be computed or received before the step"
            rows.append(item.embedding[first - item.offset:end - item.offset])
            positions.append(torch.arange(flat + first - c.start, flat + end - c.start, dtype=torch.int64))
        flat += c.length
    return torch.cat(rows).to(device), torch.cat(positions).to(device)

