"""Qwen2-VL and Qwen2.5-VL: the vision tower with its patch merger, and a Qwen2 text model with M-RoPE.

`encode_images` turns each image's patches into embedding rows of the text model's width (one per merged
2x2 block: a different count per image size); `forward` runs the text model over a batch whose image
placeholder positions take those rows, rotated at the batch's (t, h, w) positions (`batch.rope_positions`,
built by the runner from the requests' images: engine/multimodal/mrope.py).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.models.image_text import ImageTextModel
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.qwen_vl_vision import Grid, QwenVisionTower
from splitserve.engine.multimodal.qwen_vl_config import QwenVisionConfig
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel

# Checkpoint layouts -> the names this model targets: the hub's folders (and transformers 5's save_pretrained)
# write `model.layers` / `visual.`; transformers 4.5x's save_pretrained writes `model.language_model.` /
# `model.visual.`.
LAYOUT_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("language_model.lm_head.", "lm_head."),
)


class QwenVLForConditionalGeneration(ImageTextModel):
    """The text model plus the image side; `layers`, `embed_tokens` and `forward` are the text model's."""

    LAYOUT_RENAMES = LAYOUT_RENAMES

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None, image_side_only: bool = False) -> None:
        super().__init__()
        assert isinstance(cfg.vision, QwenVisionConfig)
        self.cfg = cfg
        self.vision_cfg = cfg.vision
        self.language_model = None if image_side_only else LlamaForCausalLM(cfg, tp, dtype, max_positions)
        self.visual = QwenVisionTower(cfg.vision, dtype)

    def encode_images(self, patches: list[torch.Tensor], grids: list[Grid]) -> list[torch.Tensor]:
        """Each image's patches [t*h*w, C*T*p*p] -> its rows [t*h*w / merge^2, text hidden], all in one tower pass."""
        rows = self.visual(torch.cat(patches), grids)
        return list(rows.split([self.vision_cfg.tokens_for_grid(g) for g in grids]))

    def image_modules(self) -> dict[str, nn.Module]:
        return {"visual": self.visual}
