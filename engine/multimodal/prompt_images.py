"""A chat request's images as engine `ImageItem`s: loaded and preprocessed (a unified engine
encodes them itself), or taken as references to rows an encode engine ships (disaggregated),
then placed at their expanded placeholder positions in the prompt."""

from __future__ import annotations

import asyncio
import dataclasses

from splitserve.api.openai_protocol import ApiError, ImagePart
from splitserve.engine.multimodal.image_inputs import ImageInputConfig, check_image_count, load_images
from splitserve.engine.multimodal.image_items import ImageItem, ImagePlaceholderError, expand_image_tokens
from splitserve.engine.multimodal.image_processor import ClipImageProcessor
from splitserve.engine.multimodal.vision_config import VisionConfig


async def image_items(parts: list[ImagePart], cfg: ImageInputConfig, processor: ClipImageProcessor | None,
                      vision: VisionConfig, accept_refs: bool) -> list[ImageItem]:
    """One item per part, in order: decoded and preprocessed pixels, or an encoder reference."""
    check_image_count(parts, cfg)
    refs = [p for p in parts if p.url is None]
    if refs and (not accept_refs or len(refs) != len(parts)):
        raise ApiError(f"{refs[0].where}: image_ref parts are written by the router for a disaggregated prefill "
                       "or decode engine; send image_url parts", refs[0].where)
    if refs:
        return [ImageItem(p.digest or "", -1, vision.tokens_per_image, encoder_addr=p.encoder_addr, room=p.room)
                for p in refs]
    assert processor is not None
    loaded = await load_images(parts, cfg)
    # Resizing is CPU work: off the event loop.
    pixels = await asyncio.to_thread(lambda: [processor(img.image) for img in loaded])
    return [ImageItem(img.digest, -1, vision.tokens_per_image, pixels=p) for img, p in zip(loaded, pixels, strict=True)]


def place_images(ids: list[int], items: list[ImageItem], vision: VisionConfig) -> list[int]:
    """The prompt with each placeholder widened; sets every item's offset."""
    try:
        expanded, offsets = expand_image_tokens(ids, vision.image_token_id, vision.tokens_per_image, len(items))
    except ImagePlaceholderError as exc:
        raise ApiError(f"{exc} (does the chat template render image parts?)", "messages") from None
    for item, offset in zip(items, offsets, strict=True):
        item.offset = offset
    return expanded


def copies_for_choice(items: list[ImageItem]) -> list[ImageItem]:
    """Each choice of a request (n > 1) gets its own items: the engine fills their rows in."""
    return [dataclasses.replace(item) for item in items]
