"""A prompt's images as the engine sees them: where each one's rows go in the prompt, what it is
(a content hash), and either its pixels (to encode here) or its embedding rows (encoded here or
received from an encode engine).

Placeholders: the chat template writes one image token per image; `expand_image_tokens` widens
each into the number of rows the vision tower yields, as the Hugging Face processor does.

Prefix cache: two prompts with the same placeholder tokens but different images must not share
KV, so the cache is keyed by `cache_ids`, where every placeholder position of an image carries a
key derived from that image's hash instead of the token id (never a valid token id: negative).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the router reads image hashes with no torch loaded
    import torch

# How a request whose image rows did not arrive in time fails (the API answers 408 to it).
EMBEDDING_TIMEOUT = "embedding timeout"


def image_digest(data: bytes) -> str:
    """The identity of an image: sha256 of its encoded bytes (hex)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(eq=False)
class ImageItem:
    """One image of a request: `num_tokens` prompt positions from `offset` take its embedding rows."""

    digest: str
    offset: int
    num_tokens: int
    pixels: torch.Tensor | None = None  # [C, H, W] preprocessed (Qwen-VL: [patches, patch values]), to encode here
    embedding: torch.Tensor | None = None  # [num_tokens, hidden], once encoded or received
    # Encoder disaggregation: the encode engine computing it and the room its rows arrive in.
    encoder_addr: str | None = None
    room: int | None = None
    # Qwen-VL: the image's patch grid (t, h, w), which sets its token count and its M-RoPE positions.
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def cache_key(self) -> int:
        """What the prefix cache sees at this image's positions instead of the placeholder id."""
        return -1 - int(self.digest[:15], 16)

    def describe(self) -> dict[str, Any]:
        """The wire form (no pixels, no rows): enough for a decode engine's prefix cache."""
        return {"digest": self.digest, "offset": self.offset, "num_tokens": self.num_tokens,
                "encoder_addr": self.encoder_addr, "room": self.room, "grid": self.grid}


class ImagePlaceholderError(ValueError):
    """The prompt's image tokens and the request's images do not pair up."""


def expand_image_tokens(ids: list[int], image_token_id: int, tokens_per_image: int | list[int],
                        num_images: int) -> tuple[list[int], list[int]]:
    """Widens each image token into `tokens_per_image` of them (one count for all, or each image's own);
    returns (ids, each image's offset)."""
    found = ids.count(image_token_id)
    if found != num_images:
        raise ImagePlaceholderError(f"the prompt has {found} image placeholder(s) for {num_images} image(s)")
    counts = tokens_per_image if isinstance(tokens_per_image, list) else [tokens_per_image] * num_images
    out: list[int] = []
    offsets: list[int] = []
    for t in ids:
        if t == image_token_id:
            count = counts[len(offsets)]
            offsets.append(len(out))
            out.extend([image_token_id] * count)
        else:
            out.append(t)
    return out, offsets


def cache_ids(ids: list[int], images: list[ImageItem]) -> list[int]:
    """`ids` with each image's positions replaced by its cache key (see the module docstring)."""
    if not images:
        return ids
    keyed = list(ids)
    for item in images:
        keyed[item.offset:item.end] = [item.cache_key] * item.num_tokens
    return keyed
