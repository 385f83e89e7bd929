"""Model families, one module each; `build_model` picks the one a checkpoint's config names."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


def build_model(cfg: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32,
                max_positions: int | None = None, image_side_only: bool = False) -> nn.Module:
    """The text model, or the multimodal model around it when the checkpoint takes images; `image_side_only`:
    the multimodal model's image side alone (an encode engine)."""
    if image_side_only and cfg.vision is None:
        raise ValueError(f"an image side alone was asked for (--role encode), but {cfg.architecture} takes no images")
    if cfg.mrope:
        from splitserve.engine.models.qwen_vl import QwenVLForConditionalGeneration
        return QwenVLForConditionalGeneration(cfg, tp, dtype, max_positions, image_side_only=image_side_only)
    if cfg.vision is not None:
        from splitserve.engine.models.llava import LlavaForConditionalGeneration
        return LlavaForConditionalGeneration(cfg, tp, dtype, max_positions, image_side_only=image_side_only)
    from splitserve.engine.models.llama import LlamaForCausalLM
    return LlamaForCausalLM(cfg, tp, dtype, max_positions)
