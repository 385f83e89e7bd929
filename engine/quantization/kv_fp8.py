"""FP8 (e4m3) KV cache: pages hold `float8_e4m3fn`, with a static float32 scale per layer, K or V and KV head.

A key or value x is stored as e4m3(clamp(x / scale, +-448)) and read as that times the scale. The scales are
static: a page carries no scale of its own, so every engine that reads a page (the decode engine a prefill
engine sends it to, the host and store tiers, another request that shares it through the prefix cache) must
read it with the scale it was written with, and a fixed scale (1.0) is the same in every one of them without
any agreement beyond the KV dtype. A checkpoint's calibrated `k_scale`/`v_scale` (`checkpoint_kv_scales`) are
fixed by the model too, so every engine of one model reads them alike; they replace 1.0 where present.
A scale computed at run time (from the first prompts an engine sees) would differ from engine to engine and
make pages untransferable. 1.0 is what vLLM and SGLang use without checkpoint scales: e4m3 keeps 3 mantissa
bits (a relative error of at most 1/16) from 2^-6 to 448, which holds the post-RoPE keys and the values of the
Llama family (docs/fp8.md has the measured accuracy). The kernels read one scale per (layer, K/V, KV head),
so per-head scales cost nothing; a per-tensor scale is the same value in every head.

Where it is read (engine/layers/attention.py): the torch path dequantizes the gathered pages; the Triton decode
and extend kernels load e4m3 tiles, widen them to the query's dtype and fold the key scale into the softmax
scale and the value scale into the output; where a 16-bit cache takes cuDNN (lone prompts, chunks after a cached
prefix), the e4m3 prompt attention multiplies the pages as they are (engine/layers/e4m3_prompt_attention.py), or,
with it off or on older GPUs, cuDNN attends over the dequantized keys and values read back from the pages. Either
way a prompt attends to what later steps read.
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

import torch

from splitserve.engine.quantization.fp8 import FP8_DTYPE, FP8_MAX
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# A layer's KV-cache scale in an FP8 checkpoint: ModelOpt's `...self_attn.k_proj.k_scale`, compressed-tensors'
# and vLLM's `...self_attn.k_scale` (the same for v). Each divides what is stored, as `quantize_kv` does.
# The language model's layers only (`model.layers.N`, `language_model.layers.N`): a vision tower's attention
# (`vision_tower.vision_model.encoder.layers.N`) keeps no KV cache.
KV_SCALE_NAME = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")


class KVScaleError(ValueError):
    """A checkpoint's KV-cache scales are incomplete, of the wrong shape, or not positive."""


class KVScales(NamedTuple):
    """One layer's key and value scales, float32 [kv_heads] each, on the pool's device, and whether prompts attend
    over the pages in e4m3 where cuDNN would run (engine/layers/e4m3_prompt_attention.py) or widen them first."""

    k: torch.Tensor
    v: torch.Tensor
    e4m3_prompts: bool = False


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool's pages hold: the model's for `auto`, e4m3 for `fp8_e4m3`."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, D] -> e4m3 of x / scale (scale [kv_heads]), saturated at +-448. x is rounded to its own
    dtype first (it is: the projection's output), then divided in float32, as the kernels do."""
    return (x.float() / scale.view(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [..., kv_heads, D] -> q * scale in `dtype` (computed in float32)."""
    return (q.float() * scale.view(-1, 1)).to(dtype)


def read_kv(cache: torch.Tensor, loc: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """The cache's rows at `loc` in `dtype`: dequantized when the cache is FP8 (`scale` given)."""
    rows = cache[loc]
    return rows.to(dtype) if scale is None else dequantize_kv(rows, scale, dtype)


def scales_digest(scales: torch.Tensor | None) -> str:
    """What names an FP8 KV cache's scales where pages are shared (the KV layout peers check, the store's keys):
    empty for none and for 1.0 throughout (what every engine without checkpoint scales reads with), else a digest
    of the model's whole scales (every KV head: ranks of any tensor-parallel size name them alike)."""
    if scales is None or bool((scales == 1.0).all()):
        return ""
    return "kv-scales:" + hashlib.sha256(scales.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def checkpoint_kv_scales(found: dict[str, torch.Tensor], num_layers: int, num_kv_heads: int,
                         tp: TensorParallel = SINGLE) -> torch.Tensor | None:
    """[layers, 2 (k, v), `tp` rank's KV heads] float32 from a checkpoint's KV-cache scales (`found`: name ->
    tensor, names as KV_SCALE_NAME); None when it has none. Each is one value (per tensor) or one per KV head.
    Raises KVScaleError unless every layer has both, each finite and > 0."""
    if not found:
        return None
    scales = torch.full((num_layers, 2, num_kv_heads), float("nan"), dtype=torch.float32)
    for name, tensor in found.items():
        match = KV_SCALE_NAME.search(name)
        if match is None:
            raise KVScaleError(f"{name!r} is not a KV-cache scale name")
        layer, which = int(match.group(1)), "kv".index(match.group(2))
        if layer >= num_layers:
            raise KVScaleError(f"{name}: layer {layer}, but the model has {num_layers}")
        if not bool(torch.isnan(scales[layer, which]).all()):
            raise KVScaleError(f"{name}: a second {'kv'[which]} scale for layer {layer}")
        values = tensor.detach().float().flatten()
        if values.numel() not in (1, num_kv_heads):
            raise KVScaleError(f"{name}: {values.numel()} values; a KV-cache scale is one value or one per KV head "
                               f"({num_kv_heads})")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise KVScaleError(f"{name}: KV-cache scales must be finite and positive, got {values.tolist()}")
        scales[layer, which] = values
    missing = sorted({f"{layer}.{'kv'[which]}" for layer, which in (torch.isnan(scales[:, :, 0])).nonzero().tolist()})
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise KVScaleError(f"the checkpoint has KV-cache scales for some layers but not for layer.k/v {shown}: "
                           "an FP8 KV cache needs every layer's or none")
    return rank_share(scales, tp)


def rank_share(scales: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The [layers, 2, KV heads] scales of the KV heads `tp`'s rank holds."""
    start, size = tp.shard(scales.shape[2], "KV heads")
    return scales[:, :, start:start + size].contiguous()
