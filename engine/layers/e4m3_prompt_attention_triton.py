"""A prompt's causal attention over an FP8 KV cache, in Triton: both products e4m3 x e4m3. It serves a lone
fresh prompt and a long chunk after a cached prefix (the chunk's rows over the prefix's keys and its own).

A prompt's keys and values are already e4m3 in the pages. cuDNN's 16-bit attention needs them widened
first (a dequantizing copy of every key and value) and multiplies at the 16-bit rate; this kernel reads the
e4m3 bytes as they are and runs both products on Hopper's e4m3 tensor cores, at twice the 16-bit rate:
- QK^T: each query row is quantized in registers with a scale of its own (its amax / 448, the per-token scheme
  of the prompt projections' activations) and multiplied by the e4m3 keys; the row's scale, the key scale and
  the softmax scale are applied to the float32 scores.
- PV: the softmax probabilities of a key block, taken against the running row max as flash attention does
  (each at most 1), times 256 (a power of two: no rounding of its own) so that small ones stay in e4m3's normal
  range, are rounded to e4m3 and multiplied by the e4m3 values; the float32 sum is divided by the row's exact
  (float32) probability sum, 256 and the value scale at the end.

e4m3 operands of Hopper's `wgmma` must both be K-major: the keys are (a key's head_dim values are contiguous),
the values are not, so the launcher copies the prompt's values out of the pages transposed, [kv_heads,
head_dim, tokens], tokens contiguous. Keys are gathered into a dense [tokens, kv_heads, head_dim] copy too:
a prompt's pages need not be contiguous, and the gathered tiles are what the pipeline's async copies stream.

One program per (query head, block of BLOCK_M rows); heads vary fastest, so the programs of one row block
(which read the same keys) run side by side, and the row blocks nearest the prompt's end (most keys) start
first. Key blocks that every row of a block sees skip the causal mask; the blocks at its diagonal apply it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine.layers.e4m3_prompt_attention import LAUNCH, LOG2_E, P_SCALE
from splitserve.engine.quantization.kv_fp8 import KVScales


@triton.jit
def _attend_block(acc, m_i, l_i, q8, row_scale, K, Vt, start_n, q_pos, offs_n, offs_d, kv_len, stride_kn, stride_vd,
                  DIAGONAL: tl.constexpr, P_SCALE: tl.constexpr):
    keys = start_n + offs_n
    if DIAGONAL:
        in_range = keys < kv_len
        k = tl.load(K + keys[None, :] * stride_kn + offs_d[:, None], mask=in_range[None, :], other=0.0)
    else:
        k = tl.load(K + keys[None, :] * stride_kn + offs_d[:, None])
    s = tl.dot(q8, k) * row_scale[:, None]  # [BLOCK_M, BLOCK_N], log2 units
    if DIAGONAL:
        s = tl.where(q_pos[:, None] >= keys[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DIAGONAL:
        v = tl.load(Vt + offs_d[None, :] * stride_vd + keys[:, None], mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(Vt + offs_d[None, :] * stride_vd + keys[:, None])
    p8 = (p * P_SCALE).to(tl.float8e4nv)
    acc = tl.dot(p8, v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["n", "kv_len", "prefix"])  # one compile for every length
def _e4m3_prompt_attention(Q, K, Vt, KScale, VScale, Out, n, kv_len, prefix, qk_scale, stride_qm, stride_qh,
                           stride_kn, stride_kh, stride_vh, stride_vd, stride_om, stride_oh, GROUP: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           P_SCALE: tl.constexpr):
    head = tl.program_id(0)
    start_m = (tl.cdiv(n, BLOCK_M) - 1 - tl.program_id(1)) * BLOCK_M  # the longest rows first
    kv_head = head // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < n
    row = offs_m.to(tl.int64)  # a long prompt's projection passes 2^31 elements (Llama-3.1-8B: at 350k tokens)
    q = tl.load(Q + row[:, None] * stride_qm + head * stride_qh + offs_d[None, :], mask=rows[:, None],
                other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
    q_scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)  # rounded as torch divides (`/` is approximate)
    q8 = tl.math.div_rn(q, tl.zeros_like(q) + q_scale[:, None]).to(tl.float8e4nv)
    row_scale = q_scale * (tl.load(KScale + kv_head) * qk_scale)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    K += kv_head * stride_kh
    Vt += kv_head * stride_vh
    q_pos = prefix + offs_m  # each row's position: it sees keys 0..q_pos
    diagonal = (prefix + start_m) // BLOCK_N * BLOCK_N  # the first key block some row of the block does not see
    for start_n in range(0, diagonal, BLOCK_N):  # seen by every row: no mask
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q8, row_scale, K, Vt, start_n, q_pos, offs_n, offs_d, kv_len,
                                      stride_kn, stride_vd, DIAGONAL=False, P_SCALE=P_SCALE)
    for start_n in range(diagonal, tl.minimum(prefix + start_m + BLOCK_M, kv_len), BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q8, row_scale, K, Vt, start_n, q_pos, offs_n, offs_d, kv_len,
                                      stride_kn, stride_vd, DIAGONAL=True, P_SCALE=P_SCALE)
    out = acc * (tl.load(VScale + kv_head) / P_SCALE) / l_i[:, None]
    tl.store(Out + row[:, None] * stride_om + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None])


def gather_prompt_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
                     loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's e4m3 keys [n, Hkv, D] and values transposed [Hkv, D, n rounded up to 16] (tokens contiguous,
    rows 16-byte aligned; the tail past n is never read) from the pages at `loc` [n]."""
    n, kv_heads, head_dim = loc.shape[0], k_cache.shape[1], k_cache.shape[2]
    keys = k_cache[loc]
    values_t = torch.empty(kv_heads, head_dim, triton.cdiv(n, 16) * 16, dtype=v_cache.dtype, device=v_cache.device)
    values_t[:, :, :n].copy_(v_cache[loc].permute(1, 2, 0))
    return keys, values_t


def e4m3_prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                          scales: KVScales, sm_scale: float, launch: tuple[int, int, int, int] | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] (16-bit, rows and heads may be strided views of the projection), a prompt's last n tokens, over
    the e4m3 keys and values of all its kv_len tokens at the pages' `loc` [kv_len] -> [n, H, D] in q's dtype:
    causal, query row i (position kv_len - n + i, after a cached prefix of kv_len - n) attends to keys 0..that.
    `launch` (BLOCK_M, BLOCK_N, warps, stages) overrides LAUNCH (the sweep tries them); `out`: an [n, H, D] to
    write and return instead of a new tensor."""
    n, heads, head_dim = q.shape
    kv_len = loc.shape[0]
    assert kv_len >= n
    kv_heads = k_cache.shape[1]
    assert q.stride(2) == 1 and heads % kv_heads == 0 and k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    block_m, block_n, warps, stages = launch or LAUNCH
    assert block_m % block_n == 0, "a row block's diagonal is whole key blocks"
    keys, values_t = gather_prompt_kv(k_cache, v_cache, loc)
    out = q.new_empty(n, heads, head_dim) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    _e4m3_prompt_attention[(heads, triton.cdiv(n, block_m))](
        q, keys, values_t, scales.k, scales.v, out, n, kv_len, kv_len - n, sm_scale * LOG2_E, q.stride(0),
        q.stride(1), keys.stride(0), keys.stride(1), values_t.stride(0), values_t.stride(1), out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, P_SCALE=P_SCALE,
        num_warps=warps, num_stages=stages,
    )
    return out
