"""Where a prompt over an FP8 KV cache attends in e4m3, and the numerics it computes, in torch.

With an FP8 KV cache a prompt attends to what its pages hold, as every later step reads them. Where the cuDNN
paths would run over a 16-bit cache (a lone fresh prompt; a full chunk after whole chunks of a long prompt), the
GPU kernel (engine/layers/e4m3_prompt_attention_triton.py) multiplies those e4m3 keys and values as they are,
with the query rows and the softmax probabilities rounded to e4m3 too, at the e4m3 tensor cores' rate; with
`--fp8-prompt-attention off` the pages are widened back to 16 bits for cuDNN, as before. Kept apart from the
kernel so that machines without Triton import none of it: `e4m3_prompt_attention_reference` is the kernel's
arithmetic step by step (the CPU tests check what that scheme costs against exact attention; the GPU tests hold
the kernel to it).
"""

from __future__ import annotations

import torch

from splitserve.engine.quantization.fp8 import FP8_DTYPE, FP8_MAX

PROMPT_ATTENTION_MODES = ("auto", "off")
LOG2_E = 1.4426950408889634
P_SCALE = 256.0  # probabilities times 2^8 before rounding to e4m3: exact, and clear of e4m3's subnormals
# The kernel's (BLOCK_M, BLOCK_N, warps, stages): benchmarks/e4m3_prompt_attention.py sweeps them. BLOCK_N, the
# key block, sets where the running max is taken, so the reference takes it too.
LAUNCH = (128, 128, 8, 3)
BLOCK_N = LAUNCH[1]


def e4m3_prompt_attention_runs(mode: str, kv_dtype: torch.dtype, model_dtype: torch.dtype, head_dim: int,
                               device: torch.device) -> bool:
    """Whether prompts attend in e4m3 where a 16-bit cache takes cuDNN (lone fresh prompts, full chunks after whole
    chunks): `auto` with an FP8 KV cache, a 16-bit model, a head_dim of
    32, 64 or 128 (the kernel's tiles; an e4m3 product takes 32 at a time) and a GPU with e4m3 tensor cores
    (compute capability 8.9 and up)."""
    if mode not in PROMPT_ATTENTION_MODES:
        raise ValueError(f"--fp8-prompt-attention must be one of {', '.join(PROMPT_ATTENTION_MODES)}, got {mode!r}")
    if mode == "off" or kv_dtype != FP8_DTYPE or model_dtype not in (torch.bfloat16, torch.float16):
        return False
    if head_dim not in (32, 64, 128) or device.type != "cuda":
        return False
    from splitserve.engine.quantization.fp8_cuda import e4m3_products

    return e4m3_products(device)


def quantize_query_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., D] -> (e4m3 q / scale, float32 scale [..., 1]): each row's own scale, its amax / 448."""
    qf = q.float()
    scale = qf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (qf / scale).to(FP8_DTYPE), scale


def e4m3_prompt_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k_scale: torch.Tensor,
                                    v_scale: torch.Tensor, sm_scale: float, block_n: int = BLOCK_N) -> torch.Tensor:
    """Causal attention of q [n, H, D], a prompt's last n rows, over the e4m3 keys and values of all its kv_len
    tokens [kv_len, Hkv, D] (scales [Hkv]) -> float32 [n, H, D], row i at position kv_len - n + i, as the kernel
    computes it: query rows rounded to e4m3 with their own scale; over key blocks of `block_n`,
    the scores' running row max, each block's probabilities against it times 256 rounded to e4m3 and multiplied
    by the e4m3 values, the sum rescaled as the max moves; divided by the float32 probability sum at the end."""
    n, heads, _ = q.shape
    kv_len = keys.shape[0]
    group = heads // keys.shape[1]
    q8, q_scale = quantize_query_rows(q)
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    row_scale = q_scale.squeeze(-1).T * (k_scale.float().repeat_interleave(group) * sm_scale * LOG2_E)[:, None]
    scores = torch.einsum("mhd,nhd->hmn", q8.float(), k) * row_scale[:, :, None]  # [H, n, kv_len], log2 units
    causal = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)
    scores = scores.masked_fill(~causal, float("-inf"))
    running_max = torch.full((heads, n), float("-inf"), device=q.device)
    total = torch.zeros(heads, n, device=q.device)
    acc = torch.zeros(heads, n, q.shape[2], device=q.device)
    for start in range(0, kv_len, block_n):
        block = scores[:, :, start:start + block_n]
        new_max = torch.maximum(running_max, block.amax(-1))
        p = torch.exp2(block - new_max[..., None])
        alpha = torch.exp2(running_max - new_max)
        total = total * alpha + p.sum(-1)
        p8 = (p * P_SCALE).to(FP8_DTYPE).float()
        acc = acc * alpha[..., None] + torch.einsum("hmn,nhd->hmd", p8, v[start:start + block_n])
        running_max = new_max
    out = acc * (v_scale.float().repeat_interleave(group) / P_SCALE)[:, None, None] / total[..., None]
    return out.transpose(0, 1)
