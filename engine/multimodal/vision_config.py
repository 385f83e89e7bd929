"""The vision half of a multimodal checkpoint (LLaVA: a CLIP tower and an MLP projector), read
from `config.json`. The text half is an ordinary `ModelConfig`.

Another family (Qwen2-VL style) adds its own `architecture` value and fields here, its tower
module under engine/models/, and its token count rule in `tokens_per_image`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SELECT_STRATEGIES = ("default", "full")


class UnsupportedVisionConfigError(ValueError):
    """The vision tower or projector asks for something this engine does not run."""


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision tower, the layers whose features are taken, and the projector into the text model."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # quick_gelu (OpenAI CLIP) or gelu
    image_token_id: int
    feature_layers: tuple[int, ...]  # hidden-state indices (0 = the embeddings), already non-negative
    select_strategy: str  # "default" drops the CLS row, "full" keeps it
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """How many placeholder tokens one image becomes (what the HF processor inserts)."""
        cls_row = 1 if self.select_strategy == "full" else 0
        return self.patches_per_side ** 2 + cls_row

    @property
    def layers_to_run(self) -> int:
        """Encoder layers needed: the deepest selected hidden state."""
        return max(self.feature_layers)

    @classmethod
    def from_llava(cls, cfg: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        vision = cfg.get("vision_config") or {}
        model_type = vision.get("model_type", "clip_vision_model")
        if model_type != "clip_vision_model":
            raise UnsupportedVisionConfigError(f"vision tower {model_type!r} not supported (clip_vision_model)")
        num_layers = int(vision.get("num_hidden_layers", 24))
        layer = cfg.get("vision_feature_layer", -2)
        layers = layer if isinstance(layer, list) else [layer]
        feature_layers = tuple(int(i) % (num_layers + 1) for i in layers)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise UnsupportedVisionConfigError(
                f"vision_feature_select_strategy {strategy!r} not supported ({', '.join(SELECT_STRATEGIES)})")
        act = vision.get("hidden_act", "quick_gelu")
        projector_act = cfg.get("projector_hidden_act", "gelu")
        for what, name in (("vision hidden_act", act), ("projector_hidden_act", projector_act)):
            if name not in ("gelu", "quick_gelu"):
                raise UnsupportedVisionConfigError(f"{what} {name!r} not supported (gelu, quick_gelu)")
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        if token is None:
            raise UnsupportedVisionConfigError("config.json names no image_token_index")
        image_size, patch_size = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        if image_size % patch_size:
            raise UnsupportedVisionConfigError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        return cls(
            architecture="LlavaForConditionalGeneration",
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=num_layers,
            num_heads=int(vision.get("num_attention_heads", 12)),
            image_size=image_size,
            patch_size=patch_size,
            num_channels=int(vision.get("num_channels", 3)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=act,
            image_token_id=int(token),
            feature_layers=feature_layers,
            select_strategy=strategy,
            projector_act=projector_act,
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            text_hidden_size=text_hidden_size,
        )
