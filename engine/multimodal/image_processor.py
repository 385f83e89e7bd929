"""Image preprocessing as a checkpoint's `preprocessor_config.json` (or, from transformers 5, the
`image_processor` object in `processor_config.json`) says (CLIP's recipe), with Pillow:
convert to RGB (transparency over white), resize the shortest edge, center crop, rescale, normalize.

It reproduces the Hugging Face CLIP image processor step for step (the same PIL resampling, the
same crop arithmetic), so the pixels -- and the embeddings -- equal transformers' on the same image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # transformers 4: the image processor's own file
PROCESSOR_CONFIG = "processor_config.json"  # transformers 5: the processor's, the image processor nested in it


class ImageProcessorError(ValueError):
    """The preprocessor configuration asks for a step this engine does not do."""


@dataclass(frozen=True)
class ClipImageProcessor:
    """One image in, a [3, crop_h, crop_w] float32 tensor out."""

    shortest_edge: int | None
    resize_to: tuple[int, int] | None  # (height, width) when the config gives a fixed size
    resample: int
    do_resize: bool
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ClipImageProcessor:
        size = cfg.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if "shortest_edge" in size:
            shortest, fixed = int(size["shortest_edge"]), None
        elif "height" in size and "width" in size:
            shortest, fixed = None, (int(size["height"]), int(size["width"]))
        else:
            raise ImageProcessorError(f"preprocessor size {size} not supported (shortest_edge, or height and width)")
        crop = cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=shortest, resize_to=fixed,
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            do_resize=bool(cfg.get("do_resize", True)),
            crop=(int(crop["height"]), int(crop["width"])) if cfg.get("do_center_crop", True) else None,
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)) if cfg.get("do_normalize", True) else None,
            std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)) if cfg.get("do_normalize", True) else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ClipImageProcessor:
        return cls.from_dict(image_processor_settings(folder))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing: the shortest edge to `shortest_edge`, the other in proportion."""
        if self.resize_to is not None:
            return self.resize_to
        assert self.shortest_edge is not None
        short, long = (height, width) if height <= width else (width, height)
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if height <= width else (new_long, self.shortest_edge)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = to_rgb(image)
        if self.do_resize:
            h, w = self.output_size(image.height, image.width)
            image = image.resize((w, h), resample=self.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        if self.crop is not None:
            pixels = center_crop(pixels, *self.crop)
        out = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            out = (out - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))


def image_processor_settings(folder: str | Path) -> dict[str, Any]:
    """The image processor's settings in a checkpoint folder, where either transformers generation puts them:
    transformers 5 nests them under `image_processor` in `processor_config.json`, earlier versions (and most
    hub folders) write `preprocessor_config.json`. The nested object wins where both are there, as in
    transformers' own loading."""
    folder = Path(folder)
    processor_path, preprocessor_path = folder / PROCESSOR_CONFIG, folder / PREPROCESSOR_CONFIG
    if processor_path.is_file():
        processor = json.loads(processor_path.read_text())
        nested = processor.get("image_processor") if isinstance(processor, dict) else None
        if nested is not None:
            if not isinstance(nested, dict):
                raise ImageProcessorError(f"{processor_path}: image_processor is not an object")
            return nested
    if preprocessor_path.is_file():
        return json.loads(preprocessor_path.read_text())
    raise FileNotFoundError(
        f"no image processor settings in model folder {folder}: a multimodal checkpoint needs "
        f"{PREPROCESSOR_CONFIG} (transformers 4) or {PROCESSOR_CONFIG} with an image_processor object in it "
        "(transformers 5)")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white (what transformers does)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre `height` x `width` of an [H, W, C] array, zero-padded first if it is smaller."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = -(-(padded.shape[0] - h) // 2), -(-(padded.shape[1] - w) // 2)  # ceil, as transformers
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]
