"""torch's private cuDNN attention op, called on the engine's [tokens, heads, D] layout.

SDPA's public call would not do for the two CUDA paths that use cuDNN directly: a lone prompt at a bucket
length (prompt_attention.py) must take cuDNN and nothing else, since the warm-up built exactly that graph,
and a chunk after a cached prefix (prefix_chunk_attention.py) needs the log-sum-exps of its two partial
outputs to merge them. cuDNN keys its graphs by sizes and strides, so the tensors go in as the views they
are (BSHD: [1, heads, tokens, D] over the tokens-first memory), never copied into another layout here.
Imports no Triton: attention.py, which the CPU imports, imports prompt_attention.py and so this.
"""

from __future__ import annotations

import torch


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] -> the [1, heads, tokens, D] view of the same memory (cuDNN's BSHD layout)."""
    return t.unsqueeze(0).transpose(1, 2)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [S_q, H, D], k and v [S_k, Hkv, D] (D contiguous; GQA heads as they are) -> out [S_q, H, D] and,
    with `with_lse`, the float32 log-sum-exps of each query row's scaled scores [H, S_q] (else None).
    `causal` is cuDNN's top-left mask: query i sees keys 0..i, whatever S_k is."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        heads_first(q), heads_first(k), heads_first(v), None, with_lse, 0.0, causal, False, scale=scale)[:2]
    return out.squeeze(0).transpose(0, 1), lse.reshape(lse.shape[1], lse.shape[2]) if with_lse else None
