"""The vision half of a Qwen2-VL or Qwen2.5-VL checkpoint, read from `config.json` (either the hub's flat
layout or transformers 5's `text_config` / `vision_config` split). The text half is an ordinary Qwen2
`ModelConfig` whose rotary embedding is multimodal (M-RoPE: `mrope_section`).

Unlike LLaVA, an image's token count depends on its size: the processor resizes it to a multiple of
`patch_size * spatial_merge_size` and each merged 2x2 block of patches becomes one prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class UnsupportedQwenVisionError(ValueError):
    """The vision tower asks for something this engine does not run."""


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen2-VL (LayerNorm, GELU MLP, full attention) or Qwen2.5-VL (RMSNorm, SwiGLU MLP, window attention
    with a few full-attention blocks) vision tower and its patch merger."""

    architecture: str
    hidden_size: int  # the tower's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_channels: int
    hidden_act: str
    out_hidden_size: int  # the text model's width (the merger's output)
    window_size: int  # Qwen2.5-VL: the attention window in pixels (0: every block attends to the whole image)
    fullatt_block_indexes: tuple[int, ...]
    image_token_id: int
    vision_start_token_id: int | None
    mrope_section: tuple[int, ...]  # frequency pairs of the text model's head taken by t, h and w

    @property
    def is_qwen2_5(self) -> bool:
        return self.architecture == "Qwen2_5_VLForConditionalGeneration"

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x temporal patch x patch x patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def resize_factor(self) -> int:
        """Image sides are resized to a multiple of this."""
        return self.patch_size * self.spatial_merge_size

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        """Prompt tokens of an image whose patch grid is (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size ** 2

    @classmethod
    def from_config(cls, cfg: dict[str, Any], text_hidden_size: int, head_dim: int) -> QwenVisionConfig:
        arch = next(a for a in cfg.get("architectures") or [] if a in QWEN_VL_ARCHITECTURES)
        vision = cfg.get("vision_config") or {}
        qwen2_5 = arch == "Qwen2_5_VLForConditionalGeneration"
        if qwen2_5:
            width = int(vision.get("hidden_size", 1280))
            inter = int(vision.get("intermediate_size", 3420))
            out = int(vision.get("out_hidden_size", text_hidden_size))
            act = vision.get("hidden_act", "silu")
        else:
            width = int(vision.get("embed_dim", 1280))
            inter = int(width * float(vision.get("mlp_ratio", 4)))
            out = int(vision.get("hidden_size", text_hidden_size))
            act = vision.get("hidden_act", "quick_gelu")
        if out != text_hidden_size:
            raise UnsupportedQwenVisionError(f"the vision merger's output width {out} is not the text model's "
                                             f"hidden size {text_hidden_size}")
        if act not in ("silu", "gelu", "quick_gelu", "gelu_pytorch_tanh"):
            raise UnsupportedQwenVisionError(f"vision hidden_act {act!r} not supported (silu, gelu, quick_gelu)")
        heads = int(vision.get("num_heads", 16))
        if width % heads or (width // heads) % 4:
            raise UnsupportedQwenVisionError(f"vision width {width} over {heads} heads: the head size must be a "
                                             "multiple of 4 (2D rotary positions)")
        text = cfg.get("text_config") or cfg
        token = cfg.get("image_token_id", text.get("image_token_id"))
        if token is None:
            raise UnsupportedQwenVisionError("config.json names no image_token_id")
        start = cfg.get("vision_start_token_id", text.get("vision_start_token_id"))
        rope = text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {}
        section = tuple(int(s) for s in rope.get("mrope_section", (16, 24, 24)))
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise UnsupportedQwenVisionError(f"mrope_section {list(section)} must be three parts summing to half "
                                             f"the head size ({head_dim // 2})")
        return cls(
            architecture=arch, hidden_size=width, intermediate_size=inter,
            num_layers=int(vision.get("depth", 32)), num_heads=heads,
            patch_size=int(vision.get("patch_size", 14)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            num_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            hidden_act=act, out_hidden_size=out,
            window_size=int(vision.get("window_size", 112)) if qwen2_5 else 0,
            fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31)))
            if qwen2_5 else (),
            image_token_id=int(token),
            vision_start_token_id=None if start is None else int(start),
            mrope_section=section,
        )
