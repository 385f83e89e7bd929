"""The Qwen2-VL and Qwen2.5-VL vision transformer: images of any size as sequences of patches.

A batch is every image's flattened patches one after another ([sum t*h*w, C*T*p*p]) with each image's patch
grid; patches are laid out merge block by merge block (the processor's order), so the merger's view of
four consecutive rows as one is a 2x2 block. Positions are 2D rotary (row and column halves of each head).
Attention never crosses images; Qwen2.5-VL also keeps most blocks inside windows of `window_size` pixels
(patches reordered window by window before the blocks and back after the merger). Weights are replicated on
every tensor-parallel rank (the tower is small next to the text model).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitserve.engine.multimodal.qwen_vl_config import QwenVisionConfig

Grid = tuple[int, int, int]


def vision_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return nn.functional.silu(x)
    if name == "gelu_pytorch_tanh":
        return nn.functional.gelu(x, approximate="tanh")
    return nn.functional.gelu(x)


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch, in the merge-block order the patches come in."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows, cols = (x.reshape(shape).transpose(1, 2).flatten() for x in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def image_bounds(grids: list[Grid]) -> list[int]:
    """Cumulative patch counts: frame i of the batch is patches [b[i], b[i+1]) (each frame attends alone)."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_order(grids: list[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merge-block order that puts each window's blocks together (windows of
    `window` x `window` blocks, row by row, cut short at the image's edge), and the windows' cumulative
    patch counts."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in range(t):
            for r in range(0, rows, window):
                for c in range(0, cols, window):
                    block = index[frame, r:r + window, c:c + window].flatten()
                    order.append(block + base)
                    bounds.append(bounds[-1] + block.numel() * merge * merge)
        base += t * rows * cols
    return torch.cat(order), bounds


def segment_groups(bounds: list[int], device: torch.device) -> list[torch.Tensor]:
    """The rows of the segments [bounds[i], bounds[i+1]), grouped by length: one [S, L] index per length (built
    once per tower pass, read by every block)."""
    by_length: dict[int, list[int]] = {}
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            by_length.setdefault(hi - lo, []).append(lo)
    return [(torch.tensor(starts).unsqueeze(1) + torch.arange(length)).to(device)
            for length, starts in by_length.items()]


# On CUDA the tower attends through the fused kernels alone. Left to choose, SDPA may take the math path, which
# holds each segment's whole score matrix (a 1,344 px image's full-attention block: 16 heads x 9,216^2 patches,
# 2.7 GB in bfloat16, several such at once in a batch of images), or cuDNN's, which builds a plan for every new
# sequence length, and images come in many sizes.
FUSED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """Bidirectional attention within each segment of [N, H, D] q, k, v (`segment_groups`); segments of one
    length run as one batch."""
    out = torch.empty_like(q)
    with sdpa_kernel(FUSED_ATTENTION) if q.is_cuda else contextlib.nullcontext():
        for index in groups:
            qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
            res = nn.functional.scaled_dot_product_attention(qs, ks, vs)
            out[index.flatten()] = res.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 over the whole head ([N, H, D] by [N, D] angles)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def vision_norm(cfg: QwenVisionConfig, size: int, dtype: torch.dtype) -> nn.Module:
    return VisionRMSNorm(size, 1e-6, dtype) if cfg.is_qwen2_5 else nn.LayerNorm(size, eps=1e-6, dtype=dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, dtype=dtype)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
                ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, groups)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1, activation, fc2. Qwen2.5-VL: SwiGLU-style gate, up and down projections (with biases)."""

    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.act, self.gated = cfg.hidden_act, cfg.is_qwen2_5
        d, inner = cfg.hidden_size, cfg.intermediate_size
        if self.gated:
            self.gate_proj = nn.Linear(d, inner, dtype=dtype)
            self.up_proj = nn.Linear(d, inner, dtype=dtype)
            self.down_proj = nn.Linear(inner, d, dtype=dtype)
        else:
            self.fc1 = nn.Linear(d, inner, dtype=dtype)
            self.fc2 = nn.Linear(inner, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(vision_activation(self.act, self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(vision_activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = vision_norm(cfg, cfg.hidden_size, dtype)
        self.norm2 = vision_norm(cfg, cfg.hidden_size, dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (four consecutive rows) -> one text-width row: norm, linear, GELU, linear."""

    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = vision_norm(cfg, cfg.hidden_size, dtype)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    """patches [sum t*h*w, C*T*p*p] and their grids -> [sum t*h*w / merge^2, text hidden] rows, image by image."""

    def __init__(self, cfg: QwenVisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Module()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # A Conv3d whose stride is its kernel over one patch each: a linear map of the flattened patch.
        self.patch_embed.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, stride=kernel, bias=False,
                                          dtype=dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.num_layers))
        self.merger = PatchMerger(cfg, dtype)
        head_dim = cfg.hidden_size // cfg.num_heads
        half = head_dim // 2  # rows rotate one half of each head's pairs, columns the other
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, head_dim] cos and sin of every patch (row angles, column angles, repeated for rotate-half)."""
        pos = patch_positions(grids, self.cfg.spatial_merge_size).to(device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]: rows', then columns'
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        x = nn.functional.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))
        cos, sin = self.rotary(grids, x.device)
        full = image_bounds(grids)
        windowed, unit = full, self.cfg.spatial_merge_size ** 2
        order = None
        if self.cfg.window_size:
            blocks_per_window = self.cfg.window_size // self.cfg.spatial_merge_size // self.cfg.patch_size
            order, windowed = window_order(grids, self.cfg.spatial_merge_size, blocks_per_window)
            order = order.to(x.device)

            def by_window(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(-1, unit, t.shape[-1])[order].reshape(t.shape)

            x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        full_groups = segment_groups(full, x.device)
        window_groups = segment_groups(windowed, x.device) if windowed is not full else full_groups
        for i, block in enumerate(self.blocks):
            full_attention = not self.cfg.window_size or i in self.cfg.fullatt_block_indexes
            x = block(x, cos, sin, full_groups if full_attention else window_groups)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged
