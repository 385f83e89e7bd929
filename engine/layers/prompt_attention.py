"""A lone fresh prompt's causal attention on CUDA: cuDNN at bucket lengths, flash attention where none fits.

torch's SDPA picks cuDNN for a fresh 16-bit prompt on an H200 (torch 2.11, cuDNN 9.19), and cuDNN builds a
graph for every shape it has not seen: the first call at a new length took ~62 ms more (median, 453x the
warm call; benchmarks/sdpa_shape_cost.py), on the engine thread, with every running request
waiting. Flash attention builds nothing but ran 1.6-1.8x slower warm. So a prompt is padded at the end to
the next multiple of BUCKET_STEP (q, k and v side by side as the projection wrote them, in one pad a layer:
the call's device time 1.40x the unpadded call's, against 1.89x padding each of them apart)
and attends through cuDNN at that length (cudnn_attention.py), whose graph the runner's warm-up built
(cuDNN's graphs are per thread: the engine thread's warm-up). cuDNN's causal mask is top-left, so a real
row never sees a padded key (zeros, never garbage: a masked score still multiplies its value) and the
real rows are the unpadded call's, up to cuDNN's own rounding; the padded rows are dropped. Prompts past
the largest bucket but within BUCKET_MAX (a short context's last tokens) take flash attention.

A lone prompt longer than BUCKET_MAX (chunked prefill off, or a budget over it) attends through cuDNN too, at
coarse buckets (`long_prompt_bucket`: four an octave, at most a quarter of its rows padded) whose graphs are
built on first use, once each: ~62 ms, against the hundreds of ms such a step already holds the running decodes,
where flash attention would cost every such prompt 1.6-1.8x cuDNN's attention time (an 8,192-token Llama-3-8B
prompt 34.9k tok/s against 38.8k on an H200). Warming them all up would take a forward at
every length up to the context.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitserve.engine.layers.cudnn_attention import cudnn_attention

# At most 255 padded rows: a prompt of 257 tokens attends at 512 (~4x its own attention work, at a length
# where attention is a few percent of a layer's); 8 graphs cover the default 2048-token chunk budget.
BUCKET_STEP = 256
BUCKET_MAX = 4096  # at most 16 graphs at warm-up (~62 ms each on an H200)
WARM_UP_MARGIN = 64  # the runner's warm-up prompts are at most context_length - 64 tokens
LONG_BUCKETS_PER_OCTAVE = 4  # past BUCKET_MAX: 5120, 6144, 7168, 8192, 10240, ...


def bucket_limit(longest: int, context_length: int, step: int = BUCKET_STEP, cap: int = BUCKET_MAX) -> int:
    """The largest bucket for lone prompts of up to `longest` tokens: `longest` rounded up to a multiple
    of `step`, at most `cap`, and a length the warm-up can run (context_length - 64 at most); 0: none."""
    rounded_up = -(-longest // step) * step
    return max(0, min(rounded_up, cap, (context_length - WARM_UP_MARGIN) // step * step))


def bucket_lengths(limit: int, step: int = BUCKET_STEP) -> list[int]:
    """Every bucket up to `limit`: the lengths whose cuDNN graphs the warm-up builds."""
    return list(range(step, limit + 1, step))


def prompt_bucket(length: int, limit: int, step: int = BUCKET_STEP) -> int | None:
    """The length a prompt of `length` tokens is padded to; None: past the largest bucket (flash attention, up to
    BUCKET_MAX tokens; longer prompts take `long_prompt_bucket`)."""
    bucket = -(-length // step) * step
    return bucket if bucket <= limit else None


def long_prompt_bucket(length: int, shortest: int = BUCKET_MAX, per_octave: int = LONG_BUCKETS_PER_OCTAVE) -> int:
    """The length a prompt of more than `shortest` tokens is padded to: the octave [low, 2 low] holding it (low =
    `shortest` doubled as often as needed) cut into `per_octave` equal steps, so at most a quarter of its rows are
    padding and a server meets four lengths an octave."""
    if length <= shortest:
        raise ValueError(f"a long prompt has more than {shortest} tokens, not {length}")
    low = shortest
    while length > 2 * low:
        low *= 2
    step = low // per_octave
    return -(-length // step) * step


def padded_projection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bucket: int,
                      qkv: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D], k and v [n, Hkv, D] side by side in one [bucket, (H + 2 Hkv) D] tensor, zeros after
    row n: one pad of `qkv` (the projection q, k and v are column views of, as the CUDA layer passes it),
    else of their concatenation. One layout per bucket, whichever way in, since cuDNN keys its graphs by
    strides too."""
    if qkv is None:
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    assert qkv.shape == (q.shape[0], (q.shape[1] + k.shape[1] + v.shape[1]) * q.shape[2])
    return nn.functional.pad(qkv, (0, 0, 0, bucket - q.shape[0]))


def cudnn_at_bucket(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bucket: int,
                    qkv: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D], k and v [n, Hkv, D] -> [n, H, D]: cuDNN's causal attention over the prompt padded to
    `bucket` (`qkv`: the projection they are views of, padded in one copy)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    padded = padded_projection(q, k, v, bucket, qkv)
    pq, pk, pv = padded.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    out, _ = cudnn_attention(pq.view(bucket, heads, head_dim), pk.view(bucket, kv_heads, head_dim),
                             pv.view(bucket, kv_heads, head_dim), scale, causal=True)
    return out[:q.shape[0]]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D], k and v [n, Hkv, D] -> [n, H, D]: SDPA's flash backend only (it builds nothing per shape)."""
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def lone_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, limit: int,
                          qkv: torch.Tensor | None = None) -> torch.Tensor:
    """A lone fresh prompt's causal attention (q [n, H, D], k and v [n, Hkv, D] -> [n, H, D]) with cuDNN
    buckets up to `limit` tokens built (past BUCKET_MAX, the long buckets, built on first use); `qkv`: the
    [n, (H + 2 Hkv) D] projection q, k and v are views of."""
    n = q.shape[0]
    bucket = prompt_bucket(n, limit) if n <= BUCKET_MAX else long_prompt_bucket(n)
    if bucket is None:
        return flash_attention(q, k, v, scale)
    return cudnn_at_bucket(q, k, v, scale, bucket, qkv)
