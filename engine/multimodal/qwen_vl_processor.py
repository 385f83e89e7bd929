"""Qwen2-VL / Qwen2.5-VL image preprocessing, as the checkpoint's image processor settings say, with Pillow:
convert to RGB, resize each side to a multiple of patch x merge size keeping the pixel count within
[min_pixels, max_pixels] ("smart resize"), rescale, normalize, and cut into flattened patches in the order
the vision tower reads them (each merge block's patches together), every patch repeated over the
temporal patch (an image is a one-frame video).

It reproduces transformers' Qwen2-VL image processor (the Pillow one) step for step, so the patches -- and
the embeddings -- equal transformers' on the same image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from splitserve.engine.multimodal.image_processor import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessorError,
    image_processor_settings,
    to_rgb,
)

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels] keeping the aspect."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageProcessorError(f"the image is {width}x{height}: an aspect ratio over {MAX_ASPECT_RATIO} is not "
                                  "taken")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImage:
    """One preprocessed image: its flattened patches [t*h*w, C*T*p*p] and its patch grid (t, h, w)."""

    patches: torch.Tensor
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class QwenVLImageProcessor:
    """One image in, its patches and grid out."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: int
    do_resize: bool
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> QwenVLImageProcessor:
        size = cfg.get("size") or {}
        min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        if not 0 < min_pixels <= max_pixels:
            raise ImageProcessorError(f"min_pixels {min_pixels} and max_pixels {max_pixels} must be 0 < min <= max")
        normalize = cfg.get("do_normalize", True)
        return cls(
            min_pixels=min_pixels, max_pixels=max_pixels,
            patch_size=int(cfg.get("patch_size", 14)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            merge_size=int(cfg.get("merge_size", 2)),
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            do_resize=bool(cfg.get("do_resize", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)) if normalize else None,
            std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)) if normalize else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> QwenVLImageProcessor:
        return cls.from_dict(image_processor_settings(folder))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def max_tokens(self) -> int:
        """Prompt tokens of an image at max_pixels (what an embedding slot holds; only images of extreme aspect
        ratios, whose short side is held at one merge block, come out larger)."""
        return max(self.max_pixels // self.factor ** 2, 1)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ImageProcessorError(f"with do_resize off an image's sides must be multiples of {self.factor}")
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of an image of this size (its token count follows from it)."""
        h, w = self.output_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def __call__(self, image: Image.Image) -> QwenVLImage:
        image = to_rgb(image)
        h, w = self.output_size(image.height, image.width)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), resample=self.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        out = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            out = (out - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        patches, grid = self.patchify(out.transpose(2, 0, 1))
        return QwenVLImage(torch.from_numpy(np.ascontiguousarray(patches)), grid)

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[C, H, W] -> patches [gh*gw, C*T*p*p], merge block by merge block, and the grid (1, gh, gw)."""
        c, height, width = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        blocks = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return frames.reshape(gh * gw, c * t * p * p), (1, gh, gw)
