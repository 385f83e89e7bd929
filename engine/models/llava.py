"""LLaVA: a CLIP vision tower, a two-layer MLP projector and a Llama-family text model.

`encode_images` turns preprocessed pixels into embedding rows of the text model's width (what an
encode engine computes and ships); `forward` runs the text model over a batch whose image
placeholder positions take those rows (`batch.image_rows` at `batch.image_positions`, gathered by
the runner from the requests' image items). The text model is the engine's ordinary Llama, so paged KV, chunked
prefill, prefix caching and CUDA-graph decodes work unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.models.clip_vision import ClipVisionTower, activation
from splitserve.engine.models.image_text import ImageTextModel
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel

# Checkpoint layouts -> the names this model targets. The hub's llava-hf folders nest the tower in
# `vision_model` and the text model in `language_model.model`; transformers 4.5x's save_pretrained
# writes `model.language_model` / `model.vision_tower`; 5.x writes `vision_tower.` without `vision_model`.
LAYOUT_RENAMES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaProjector(nn.Module):
    """Vision features -> text embeddings: linear, GELU, linear."""

    def __init__(self, in_features: int, out_features: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = act
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class LlavaForConditionalGeneration(ImageTextModel):
    """The text model plus the image side; `layers`, `embed_tokens` and `forward` are the text model's."""

    LAYOUT_RENAMES = LAYOUT_RENAMES

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, image_side_only: bool = False) -> None:
        super().__init__()
        assert cfg.vision is not None
        self.cfg = cfg
        self.vision_cfg = cfg.vision
        self.language_model = None if image_side_only else LlamaForCausalLM(cfg, tp, dtype, max_positions)
        self.vision_tower = ClipVisionTower(cfg.vision, dtype)
        feature_width = cfg.vision.hidden_size * len(cfg.vision.feature_layers)
        self.multi_modal_projector = LlavaProjector(feature_width, cfg.hidden_size, cfg.vision.projector_act,
                                                    cfg.vision.projector_bias, dtype)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] preprocessed pixels -> [N, tokens_per_image, text hidden] embedding rows."""
        return self.multi_modal_projector(self.vision_tower(pixels.to(self.multi_modal_projector.linear_1.weight)))

    def image_modules(self) -> dict[str, nn.Module]:
        return {"vision_tower": self.vision_tower, "multi_modal_projector": self.multi_modal_projector}
