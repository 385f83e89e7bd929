"""A chat request's images as engine `ImageItem`s: loaded and preprocessed (a unified engine
encodes them itself), or taken as references to rows an encode engine ships (disaggregated),
then placed at their expanded placeholder positions in the prompt."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from splitserve.api.openai_protocol import ApiError, ImagePart
from splitserve.engine.multimodal.image_inputs import (
    ImageInputConfig,
    LoadedImage,
    check_image_count,
    load_images,
)
from splitserve.engine.multimodal.image_items import ImageItem, ImagePlaceholderError, expand_image_tokens
from splitserve.engine.multimodal.image_processor import ClipImageProcessor, ImageProcessorError
from splitserve.engine.multimodal.qwen_vl_config import QwenVisionConfig
from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor
from splitserve.engine.multimodal.vision_config import VisionConfig

ImageProcessor = ClipImageProcessor | QwenVLImageProcessor


def image_processor_for(vision: VisionConfig | QwenVisionConfig, folder: str | Path) -> ImageProcessor:
    """The preprocessing of a checkpoint's images: CLIP's (LLaVA) or the smart resize (Qwen-VL)."""
    if isinstance(vision, QwenVisionConfig):
        return QwenVLImageProcessor.from_folder(folder)
    return ClipImageProcessor.from_folder(folder)


def max_image_tokens(vision: VisionConfig | QwenVisionConfig, processor: ImageProcessor) -> int:
    """The most rows one image has: LLaVA's fixed count, Qwen-VL's at the processor's max_pixels."""
    if isinstance(processor, QwenVLImageProcessor):
        return processor.max_tokens
    assert isinstance(vision, VisionConfig)
    return vision.tokens_per_image


def preprocess(processor: ImageProcessor, vision: VisionConfig | QwenVisionConfig, loaded: LoadedImage) -> ImageItem:
    """An item with the image's pixels (Qwen-VL: patches and grid) and its token count."""
    if isinstance(processor, QwenVLImageProcessor):
        assert isinstance(vision, QwenVisionConfig)
        try:
            image = processor(loaded.image)
        except ImageProcessorError as exc:
            raise ApiError(f"{loaded.part.where}: {exc}", loaded.part.where, code="invalid_image") from None
        return ImageItem(loaded.digest, -1, vision.tokens_for_grid(image.grid), pixels=image.patches,
                         grid=image.grid)
    assert isinstance(vision, VisionConfig)
    return ImageItem(loaded.digest, -1, vision.tokens_per_image, pixels=processor(loaded.image))


def image_ref_item(part: ImagePart, vision: VisionConfig | QwenVisionConfig) -> ImageItem:
    """An item whose rows an encode engine ships; a Qwen-VL image's token count and positions follow from the
    grid its encoder answered with."""
    if isinstance(vision, QwenVisionConfig):
        if part.grid is None:
            raise ApiError(f"{part.where}: an image_ref for a Qwen-VL model needs the image's 'grid'", part.where)
        _, h, w = part.grid
        merge = vision.spatial_merge_size
        if h % merge or w % merge:
            raise ApiError(f"{part.where}: grid {list(part.grid)} is not whole merge blocks of {merge}", part.where)
        return ImageItem(part.digest or "", -1, vision.tokens_for_grid(part.grid), encoder_addr=part.encoder_addr,
                         room=part.room, grid=part.grid)
    return ImageItem(part.digest or "", -1, vision.tokens_per_image, encoder_addr=part.encoder_addr, room=part.room)


async def image_items(parts: list[ImagePart], cfg: ImageInputConfig, processor: ImageProcessor | None,
                      vision: VisionConfig | QwenVisionConfig, accept_refs: bool) -> list[ImageItem]:
    """One item per part, in order: decoded and preprocessed pixels, or an encoder reference."""
    check_image_count(parts, cfg)
    refs = [p for p in parts if p.url is None]
    if refs and (not accept_refs or len(refs) != len(parts)):
        raise ApiError(f"{refs[0].where}: image_ref parts are written by the router for a disaggregated prefill "
                       "or decode engine; send image_url parts", refs[0].where)
    if refs:
        return [image_ref_item(p, vision) for p in refs]
    assert processor is not None
    loaded = await load_images(parts, cfg)
    # Resizing is CPU work: off the event loop.
    return await asyncio.to_thread(lambda: [preprocess(processor, vision, img) for img in loaded])


def place_images(ids: list[int], items: list[ImageItem], vision: VisionConfig | QwenVisionConfig) -> list[int]:
    """The prompt with each placeholder widened to its image's token count; sets every item's offset."""
    try:
        expanded, offsets = expand_image_tokens(ids, vision.image_token_id, [it.num_tokens for it in items],
                                                len(items))
    except ImagePlaceholderError as exc:
        raise ApiError(f"{exc} (does the chat template render image parts?)", "messages") from None
    for item, offset in zip(items, offsets, strict=True):
        item.offset = offset
    return expanded


def copies_for_choice(items: list[ImageItem]) -> list[ImageItem]:
    """Each choice of a request (n > 1) gets its own items: the engine fills their rows in."""
    return [dataclasses.replace(item) for item in items]
