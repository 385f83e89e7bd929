"""Model families, one module each; `build_model` picks the one a checkpoint's config names."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


def build_model(cfg: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32,
                max_positions: int | None = None) -> nn.Module:
    """The text model, or the multimodal model around it when the checkpoint takes images."""
    if cfg.mrope:
        from splitserve.engine.models.qwen_vl import QwenVLForConditionalGeneration
        return QwenVLForConditionalGeneration(cfg, tp, dtype, max_positions)
    if cfg.vision is not None:
        from splitserve.engine.models.llava import LlavaForConditionalGeneration
        return LlavaForConditionalGeneration(cfg, tp, dtype, max_positions)
    from splitserve.engine.models.llama import LlamaForCausalLM
    return LlamaForCausalLM(cfg, tp, dtype, max_positions)
