"""The CLIP vision transformer as LLaVA uses it: patch + class + position embeddings, a pre-norm,
and encoder layers whose hidden states are read at the configured feature layers.

Images are a fixed size (the processor crops them), so a batch is a plain [N, C, H, W] tensor
and attention has no mask. Weights are replicated on every tensor-parallel rank (the tower is small).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.multimodal.vision_config import VisionConfig


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return nn.functional.gelu(x)


class ClipEmbeddings(nn.Module):
    """A strided convolution per patch, a learned class row in front, learned positions added."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2 + 1, cfg.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention with biased projections."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, d, dtype=dtype)
        self.k_proj = nn.Linear(d, d, dtype=dtype)
        self.v_proj = nn.Linear(d, d, dtype=dtype)
        self.out_proj = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, d // self.num_heads).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                                         heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, d))


class ClipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = ClipAttention(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mlp = ClipMLP(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg, dtype) for _ in range(cfg.num_layers))


class ClipVisionTower(nn.Module):
    """pixels [N, C, H, W] -> the selected hidden states, concatenated on the feature axis [N, rows, D*k]."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = ClipEmbeddings(cfg, dtype)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)  # CLIP's spelling
        self.encoder = ClipEncoder(cfg, dtype)
        # Loaded because checkpoints carry it; LLaVA reads hidden states, never the pooled output.
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = {0: x}
        for i in range(self.cfg.layers_to_run):  # layers past the deepest selected one are never run
            x = self.encoder.layers[i](x)
            states[i + 1] = x
        selected = [states[i] for i in self.cfg.feature_layers]
        if self.cfg.select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        return torch.cat(selected, dim=-1)
