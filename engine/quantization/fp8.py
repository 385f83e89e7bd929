"""FP8 (e4m3) weights: the schemes a checkpoint's config names, quantizing and dequantizing, and the matmul.

A quantized projection holds its weight as `float8_e4m3fn` [N, K] with a float32 scale per output channel
(`weight_scale` [N]; a checkpoint's per-tensor scale is written to each of its rows, so the fused q/k/v and
gate/up projections keep each part's own scale), and, for static activation scales, a float32 `input_scale`
[1] (the largest of the fused parts'). W = q * weight_scale[:, None]; an activation x is x_q * input_scale.

Where each runs (docs/fp8.md):
- CUDA: the weights stay FP8 (1 byte a parameter). Past the layer's row-invariant rows (16 by default: decode)
  the activations are quantized (per token, or with the static scale) by a Triton kernel and `torch._scaled_mm`
  multiplies e4m3 by e4m3 with row-wise float32 scales into bfloat16 (W8A8). Up to them, with
  `--fp8-decode-rows w8a8` (the default; bfloat16 rows, a scheme that quantizes row by row, a GPU with e4m3
  tensor cores) the rows are quantized the same way and a skinny kernel multiplies e4m3 by e4m3 with the weight
  on the product's wide side; otherwise a skinny Triton kernel reads the weight once and widens it to the rows'
  dtype in registers (16-bit activations, W8A16). No host sync anywhere: CUDA-graph safe.
- CPU: the weights are dequantized to the compute dtype on load (the layer then runs as an unquantized one:
  4 bytes a parameter in float32, no saving), so an FP8 checkpoint gives exactly the logits of its dequantized
  weights. A layer built with FP8 storage on the CPU (tests) dequantizes per matmul instead.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or activation still gets a usable scale

WEIGHT_STRATEGIES = ("tensor", "channel")
# How activations are quantized for the W8A8 product: per token (dynamic), per tensor computed from the rows
# (dynamic), with the checkpoint's static per-tensor scale, or not at all (a weight-only checkpoint: on the GPU
# its prompt rows are then quantized per token, its decode rows take the weight-only kernel as every scheme's do).
ACTIVATION_SCHEMES = ("dynamic-token", "dynamic-tensor", "static-tensor", "none")
# The schemes whose rows can be quantized as they are made (per row, or with the static scale): a kernel that
# makes a projection's input can write it in e4m3 (swiglu_quantized). A dynamic per-tensor scale needs the whole
# tensor's amax first.
ROW_QUANTIZED_ACTIVATIONS = ("dynamic-token", "none", "static-tensor")
# What decode rows (those up to a layer's skinny rows) take: quantized as prompt rows are into an e4m3 x e4m3
# product (W8A8, the default: the prompt path's numerics, and a skinny kernel that spends fewer instructions per
# weight byte), or 16-bit into a product that widens the weight (W8A16). W8A8 applies to schemes that quantize
# their activations row by row; a weight-only checkpoint's decode rows stay 16-bit.
DECODE_ROWS = ("w8a16", "w8a8")
DECODE_QUANTIZED_ACTIVATIONS = ("dynamic-token", "static-tensor")


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's `quantization_config` names a scheme this engine does not run."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are quantized to FP8, from its checkpoint or from `--quantization fp8`."""

    source: str  # "compressed-tensors", "modelopt", "fp8" (AutoFP8's per-tensor layout), "online"
    weight_strategy: str = "channel"  # the checkpoint's weight_scale: one per tensor or one per output channel
    activation: str = "dynamic-token"
    ignore: tuple[str, ...] = ()  # module names (or patterns) left unquantized, as the checkpoint lists them
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors' targets: "Linear" or "re:" patterns
    decode_rows: str = "w8a8"  # one of DECODE_ROWS (--fp8-decode-rows)

    @property
    def checkpoint_fp8(self) -> bool:
        """Whether the checkpoint's tensors are FP8 with scales beside them (else they are quantized on load)."""
        return self.source != "online"

    @property
    def static_input(self) -> bool:
        return self.activation == "static-tensor"

    @property
    def quantizes_decode_rows(self) -> bool:
        """Whether decode rows are quantized before their product (W8A8) where the GPU has e4m3 tensor cores."""
        return self.decode_rows == "w8a8" and self.activation in DECODE_QUANTIZED_ACTIVATIONS

    def quantizes(self, module: str) -> bool:
        """Whether the projection named `module` (`model.layers.0.self_attn.q_proj`) is FP8 in this scheme."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return False
        return any(t == "Linear" or _matches(module, t) for t in self.targets)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def online_scheme() -> Fp8Scheme:
    """`--quantization fp8`: per-channel weight scales computed on load, activations quantized per token."""
    return Fp8Scheme(source="online", weight_strategy="channel", activation="dynamic-token")


def scheme_from_config(cfg: dict[str, Any], folder: str | Path | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint: its config.json's `quantization_config`, or ModelOpt's
    `hf_quant_config.json` beside it; None for an unquantized checkpoint. Other schemes raise."""
    qc = cfg.get("quantization_config")
    if qc is None and folder is not None and (Path(folder) / "hf_quant_config.json").is_file():
        qc = {"quant_method": "modelopt", **json.loads((Path(folder) / "hf_quant_config.json").read_text())}
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt" or "quant_algo" in qc or "quantization" in qc:
        return _modelopt(qc)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise UnsupportedQuantizationError(
                f"block-wise FP8 (weight_block_size {qc['weight_block_size']}, weight_scale_inv) is not supported; "
                "per-tensor and per-channel FP8 are (compressed-tensors, ModelOpt FP8)")
        scheme = qc.get("activation_scheme", "dynamic")
        return Fp8Scheme(source="fp8", weight_strategy="tensor",
                         activation="static-tensor" if scheme == "static" else "dynamic-token",
                         ignore=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))
    raise UnsupportedQuantizationError(f"quantization method {method!r} is not supported (FP8: compressed-tensors, "
                                       "modelopt; or --quantization fp8 on a 16/32-bit checkpoint)")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} is not supported (float-quantized)")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors quantization_config has no config_groups")
    schemes, targets = set(), []
    for group in groups:
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise UnsupportedQuantizationError(f"compressed-tensors weights {w.get('type')}/{w.get('num_bits')} "
                                               "bits are not supported (FP8: float, 8 bits)")
        strategy = w.get("strategy", "tensor")
        if strategy not in WEIGHT_STRATEGIES or w.get("group_size") or w.get("block_structure") \
                or not w.get("symmetric", True):
            raise UnsupportedQuantizationError(f"compressed-tensors FP8 weight strategy {strategy!r} is not supported "
                                               "(symmetric, per tensor or per channel)")
        a = group.get("input_activations")
        if a is None:
            activation = "none"
        else:
            if a.get("type", "float") != "float" or int(a.get("num_bits", 8)) != 8:
                raise UnsupportedQuantizationError("compressed-tensors input activations must be FP8")
            a_strategy = a.get("strategy", "tensor")
            if a.get("dynamic"):
                activation = "dynamic-token" if a_strategy == "token" else "dynamic-tensor"
            elif a_strategy == "tensor":
                activation = "static-tensor"
            else:
                raise UnsupportedQuantizationError(f"static {a_strategy!r} activation scales are not supported")
        schemes.add((strategy, activation))
        targets += list(group.get("targets") or ["Linear"])
    if len(schemes) > 1:
        raise UnsupportedQuantizationError(f"compressed-tensors groups with different FP8 schemes {sorted(schemes)}")
    ((strategy, activation),) = schemes
    return Fp8Scheme(source="compressed-tensors", weight_strategy=strategy, activation=activation,
                     ignore=tuple(qc.get("ignore") or ()), targets=tuple(targets))


def _modelopt(qc: dict[str, Any]) -> Fp8Scheme:
    inner = qc.get("quantization") or qc  # hf_quant_config.json nests it; config.json's copy may not
    algo = str(inner.get("quant_algo", "")).upper()
    ignore = tuple(inner.get("exclude_modules") or qc.get("exclude_modules") or ())
    if algo == "FP8":
        return Fp8Scheme(source="modelopt", weight_strategy="tensor", activation="static-tensor", ignore=ignore)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Fp8Scheme(source="modelopt", weight_strategy="channel", activation="dynamic-token", ignore=ignore)
    raise UnsupportedQuantizationError(f"ModelOpt quant_algo {algo!r} is not supported (FP8, "
                                       "FP8_PER_CHANNEL_PER_TOKEN)")


def nan_codes(q: torch.Tensor) -> int:
    """How many of an e4m3 tensor's codes are NaN (0x7F, 0xFF; e4m3fn has no infinities). A checkpoint must hold
    none: the CUDA kernels widen e4m3 to bfloat16 in integer operations that take those two codes for +-480
    (engine/layers/e4m3_triton.py), and a NaN weight is a corrupt one anyway."""
    return int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 scales [N]) of a weight [N, K]: each row's absolute max maps to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 of x / scale (scale broadcast against x), saturated at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale per row ([N] or a scalar scale), in float32, then cast to `dtype`."""
    s = scale.float().reshape(-1)
    s = s[:, None] if s.numel() > 1 else s
    return (q.float() * s).to(dtype)


def quantize_activation(x: torch.Tensor, activation: str, input_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows [M, K], float32 scales [M, 1]) of activations x [M, K], in torch ops (the reference and
    the fallback of the Triton kernel): per token, per tensor from the rows, or with the static scale."""
    xf = x.float()
    if activation == "static-tensor":
        assert input_scale is not None
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    elif activation == "dynamic-tensor":
        scale = (xf.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1, 1).expand(x.shape[0], 1)
    else:  # per token ("none": what a weight-only checkpoint's prompt rows get on the GPU)
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_with_scale(xf, scale), scale.contiguous()


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None, bias: torch.Tensor | None, activation: str | None
                         ) -> torch.Tensor:
    """x @ dequant(W).T (+ bias) in float32, cast to x's dtype: the CPU's per-matmul path and the GPU tests'
    reference. `activation`: quantize x first as the W8A8 GEMM does (None: x as it is, as the skinny kernel)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if activation is not None:
        xq, xs = quantize_activation(x2, activation, input_scale)
        xf = xq.float() * xs
    else:
        xf = x2.float()
    y = xf @ dequantize(weight, weight_scale, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this product: CUDA, bfloat16 rows, K and N multiples of 16."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, activation: str, skinny_rows: int,
               arrivals: torch.Tensor | None = None, decode_w8a8: bool = False) -> torch.Tensor:
    """y = x W^T (+ bias) for an FP8 weight [N, K] with per-channel scales [N]: on CUDA a skinny kernel up to
    `skinny_rows` rows (`arrivals`: the layer's counters for its K parts, fp8_cuda.arrival_counters), the W8A8
    GEMM past them (bfloat16 rows); elsewhere the reference. `decode_w8a8` (the scheme's quantizes_decode_rows):
    bfloat16 skinny rows are quantized first and multiplied in e4m3 where the GPU can (decode_rows_quantized);
    else the skinny kernel takes them as they are (W8A16, any dtype)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] > 0:
        from splitserve.engine.quantization import fp8_cuda

        if x.shape[0] <= skinny_rows or x.dtype == torch.float32:
            if decode_w8a8 and decode_rows_quantized(x):
                xq, xs = fp8_cuda.quantize_rows(x, activation, input_scale)
                return fp8_cuda.skinny_fp8_rows(xq, xs, weight, weight_scale, bias, x.dtype, max_rows=skinny_rows,
                                                arrivals=arrivals)
            return fp8_cuda.skinny_fp8(x, weight, weight_scale, bias, max_rows=skinny_rows, arrivals=arrivals)
        if scaled_mm_fits(x, weight):
            return fp8_cuda.scaled_mm_linear(x, weight, weight_scale, input_scale, bias, activation)
    return fp8_linear_reference(x, weight, weight_scale, input_scale, bias,
                                None if activation == "none" or not x.is_cuda else activation)


def decode_rows_quantized(x: torch.Tensor) -> bool:
    """Whether rows like `x` (bfloat16, on a GPU with e4m3 tensor cores) can go W8A8 through the skinny kernel,
    for a scheme whose quantizes_decode_rows says so."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    from splitserve.engine.quantization import fp8_cuda

    return fp8_cuda.e4m3_products(x.device)


def swiglu_quantized(gate_up: torch.Tensor, activation: str, input_scale: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of a [M, 2N] gate_up as the down projection's e4m3 rows and [M, 1] scales, in one CUDA
    kernel (fp8_cuda.silu_mul_quantize): the bits of quantizing silu_and_mul's output."""
    from splitserve.engine.quantization import fp8_cuda

    return fp8_cuda.silu_mul_quantize(gate_up, activation, input_scale)
