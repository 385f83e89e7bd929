"""A long prompt chunk after a cached prefix, on CUDA: two cuDNN attention calls merged by their
log-sum-exps.

The paged extend kernel (paged_extend_triton.py) runs a 2048-token chunk after 6144 cached tokens at
~400 TFLOP/s on an H200, where cuDNN's fused attention runs a fresh prompt at ~610. cuDNN's causal
mask is aligned top-left (query i sees keys 0..i), which is not a chunk's mask over [prefix + chunk]
keys, so the chunk attends in two parts: over the prefix with every key visible (no mask), and over
its own keys causally (a square mask, where top-left is the chunk's diagonal). Each call (cudnn_attention.py)
returns, per query row, the log-sum-exp of its scaled scores; one pass merges the two partial outputs:
out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2). The chunk's KV is first gathered from its pages
into one contiguous copy (Llama-3.1-8B: 4 KB per token for K and V of one layer, 32 MB at 8192 tokens).
cuDNN builds a graph per shape on first use (50-110 ms on an H200), so the runner sends only full chunks
after whole chunks here (engine/layers/extend_plan.py) and builds those graphs at warm-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.cudnn_attention import cudnn_attention
from splitserve.engine.layers.extend_plan import PrefixChunk


# The chunk's length and the per-head strides of the log-sum-exps ([H, n]) vary by chunk: not compiled per value.
@triton.jit(do_not_specialize=["n", "stride_l1h", "stride_l2h"])
def _merge_kernel(O1, O2, L1, L2, Out, n,
                  stride_o1h, stride_o1t, stride_o2h, stride_o2t, stride_l1h, stride_l1t, stride_l2h, stride_l2t,
                  stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = t < n
    cell = ok[:, None] & (d[None, :] < HEAD_DIM)
    lse1 = tl.load(L1 + h * stride_l1h + t * stride_l1t, mask=ok, other=0.0)
    lse2 = tl.load(L2 + h * stride_l2h + t * stride_l2t, mask=ok, other=0.0)
    m = tl.maximum(lse1, lse2)
    w1 = tl.exp(lse1 - m)
    w2 = tl.exp(lse2 - m)
    o1 = tl.load(O1 + h * stride_o1h + t[:, None] * stride_o1t + d[None, :], mask=cell, other=0.0)
    o2 = tl.load(O2 + h * stride_o2h + t[:, None] * stride_o2t + d[None, :], mask=cell, other=0.0)
    out = (o1.to(tl.float32) * w1[:, None] + o2.to(tl.float32) * w2[:, None]) / (w1 + w2)[:, None]
    tl.store(Out + t[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(Out.dtype.element_ty), mask=cell)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, out: torch.Tensor
                 ) -> None:
    """Writes softmax-weighted o1, o2 ([S, H, D], their lse [H, S]) into out [S, H, D]."""
    n, heads, head_dim = o1.shape
    assert o1.stride(-1) == o2.stride(-1) == out.stride(-1) == 1
    block_t = 32
    _merge_kernel[(triton.cdiv(n, block_t), heads)](
        o1, o2, lse1, lse2, out, n, o1.stride(1), o1.stride(0), o2.stride(1), o2.stride(0), *lse1.stride(),
        *lse2.stride(), out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=block_t, num_warps=4,
    )


def prefix_chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefixChunk,
                           scale: float, out: torch.Tensor) -> None:
    """q, out: the step's [T, H, D]; keys, values: this chunk's gathered KV [kv_len, Hkv, D] (prefix, then
    the chunk's own tokens, already stored). Writes the chunk's rows of out."""
    rows = slice(chunk.row, chunk.row + chunk.length)
    query = q[rows]
    o1, lse1 = cudnn_attention(query, keys[:chunk.prefix], values[:chunk.prefix], scale, causal=False, with_lse=True)
    o2, lse2 = cudnn_attention(query, keys[chunk.prefix:], values[chunk.prefix:], scale, causal=True, with_lse=True)
    assert lse1 is not None and lse2 is not None
    merge_by_lse(o1, lse1, o2, lse2, out[rows])


def build_cudnn_graphs(chunk: int, prefixes: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device) -> None:
    """Runs the path once for each prefix on inputs laid out as the engine's (the queries a view of the
    qkv projection, the KV gathered), so that cuDNN builds every shape's graph before a request waits."""
    if not prefixes:
        return
    qkv = torch.zeros(chunk, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, :heads * head_dim].view(chunk, heads, head_dim)
    kv = torch.zeros(max(prefixes) + chunk, kv_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty(chunk, heads, head_dim, dtype=dtype, device=device)
    for prefix in prefixes:
        prefix_chunk_attention(q, kv[:prefix + chunk], kv[:prefix + chunk], PrefixChunk(0, 0, chunk, prefix, 0),
                               head_dim ** -0.5, out)
