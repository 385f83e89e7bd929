"""16-bit GEMMs in an engine whose SMs an MPS cap limits (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100).

Under such a cap cuBLAS computes some shapes wrong and reports nothing. On an H100 with CUDA 13 and the cap at
60% (78 of 132 SMs), torch.mm's own pick for [17, 4096] x [4096, 6144] was off by 84% of the largest output,
[192, 4096] x [4096, 128256] left 884,736 of its outputs unwritten, and a capped decode engine's logits turned
NaN a few hundred steps into a load. Of the cuBLASLt algorithms offered for seven projection shapes, every one that
came out wrong launches thread-block clusters of four or more CTAs, and every one with clusters of one or two
CTAs came out right; at 99% (130 SMs), or with no cap, all of them did.

So under a cap every 16-bit projection that would go to cuBLAS goes through cuBLASLt with an algorithm whose
clusters hold at most two CTAs: one its heuristic offers, or else an offered one with its clusters made 1x1x1 or
2x1x1 (for some shapes every offered algorithm has clusters of four or eight). At start-up each shape the CUDA
graphs will run (decode, verify, lone-prompt and piecewise) is checked against a float32 product: a shape whose
algorithm is wrong takes the next candidate that is right, and an engine with a shape that none computes right
refuses to start. FP8 projections are checked the same way where graphs run them, with nothing else to choose.
Eager steps' shapes rest on the cluster rule alone (a check per new row count would stall the step), and FP8
prompt steps past the graphs' sizes on cuBLASLt's own pick. An engine that would run an image side's plain
`nn.Linear` layers (cuBLAS's own pick) under a cap refuses to start.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping

import torch

logger = logging.getLogger(__name__)

SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# cublasLtClusterShape_t values of clusters of one or two CTAs: 1x1x1, 2x1x1, 1x2x1.
SMALL_CLUSTER_SHAPES = frozenset({2, 3, 5})
CANDIDATES = 16  # heuristic algorithms asked for per shape
# A right bf16 product of random rows differs from the float32 one by a few tenths of a percent of its largest
# value; the wrong ones measured were off by 48% or more.
TOLERANCE = 0.02


class CappedGemmError(RuntimeError):
    """No cuBLASLt algorithm computes a projection shape right under this engine's SM cap."""


def sm_cap_percent(env: Mapping[str, str] | None = None) -> int | None:
    """The MPS SM cap of this process, in percent (None: not capped). ValueError if the variable is not a whole
    number from 1 to 100."""
    value = (os.environ if env is None else env).get(SM_PERCENT_ENV, "").strip()
    if not value:
        return None
    try:
        percent = int(value)
    except ValueError:
        raise ValueError(f"{SM_PERCENT_ENV}={value!r} is not a whole number of percent") from None
    if not 1 <= percent <= 100:
        raise ValueError(f"{SM_PERCENT_ENV}={percent} is outside 1..100")
    return percent if percent < 100 else None


def small_clusters(config: Mapping[str, int]) -> bool:
    """Whether an algorithm's config (cublaslt.Algo.config) launches clusters of at most two CTAs."""
    return config.get("cluster_shape") in SMALL_CLUSTER_SHAPES


def candidates(rows: int, n: int, k: int, dtype: torch.dtype) -> list:
    """cuBLASLt algorithms for x[rows, k] @ W[n, k]^T, the ones with small clusters first: those its heuristic
    offers with clusters of one or two CTAs, then each other offered one with its clusters made 1x1x1 or 2x1x1
    where cuBLASLt accepts that, then the rest as offered (cublaslt.Algo each)."""
    from splitserve.engine.layers import cublaslt

    offered = cublaslt.heuristic_algos(rows, n, k, dtype, count=CANDIDATES)
    small = [a for a in offered if small_clusters(a.config)]
    large = [a for a in offered if not small_clusters(a.config)]
    for algo in large:
        for shape in sorted(SMALL_CLUSTER_SHAPES):
            changed = cublaslt.with_config(rows, n, k, dtype, algo, "cluster_shape", shape)
            if changed is not None and changed not in small:
                small.append(changed)
                break
    return small + large


@functools.cache
def algo_for(rows: int, n: int, k: int, dtype: torch.dtype):
    """The algorithm an SM-capped engine runs for x[rows, k] @ W[n, k]^T where its start-up check chose none: the
    first of `candidates` with small clusters; CappedGemmError if there is none."""
    offered = candidates(rows, n, k, dtype)
    for algo in offered:
        if small_clusters(algo.config):
            return algo
    raise CappedGemmError(f"under the MPS SM cap ({SM_PERCENT_ENV}) cuBLASLt has no algorithm with clusters of at "
                          f"most two CTAs for [{rows}, {k}] x [{k}, {n}] ({dtype}); cluster shapes offered: "
                          f"{sorted({a.config.get('cluster_shape') for a in offered})}")


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def projection_shapes(modules: Iterable[torch.nn.Module], rows: Iterable[int], lm_head: bool = True
                      ) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, torch.nn.Module]]]:
    """What a capped engine checks for steps of `rows` rows: (rows, weight) of each distinct 16-bit projection
    shape and (rows, layer) of each distinct FP8 one, among the projection layers of `modules` (those with
    `skinny_rows`: the linear layers and the LM head, left out where not `lm_head`) past their skinny rows."""
    rows = sorted(set(rows))
    sixteen_bit: dict[tuple, tuple[int, torch.Tensor]] = {}
    fp8: dict[tuple, tuple[int, torch.nn.Module]] = {}
    for m in modules:
        weight = getattr(m, "weight", None)
        if not hasattr(m, "skinny_rows") or weight is None or (not lm_head and not hasattr(m, "fp8")):
            continue  # (the LM head is the projection layer without an FP8 state)
        for r in rows:
            if r <= m.skinny_rows:
                continue  # the row-invariant Triton kernels
            if getattr(m, "fp8", False):
                fp8.setdefault((r, *weight.shape), (r, m))
            elif weight.dtype in SIXTEEN_BIT:
                sixteen_bit.setdefault((r, *weight.shape, weight.dtype), (r, weight))
    return list(sixteen_bit.values()), list(fp8.values())


def reference_product(x: torch.Tensor, weight: torch.Tensor, columns: int = 8192) -> torch.Tensor:
    """x @ weight^T in float32, `columns` output features at a time (an LM head's float32 copy whole would be
    2 GB more, on a GPU whose memory the KV cache already took)."""
    xf = x.float()
    return torch.cat([xf @ weight[i:i + columns].float().t() for i in range(0, weight.shape[0], columns)], dim=1)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference from `reference` over its largest magnitude (inf if `out` is not finite)."""
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.float() - reference).abs().max()) / max(float(reference.abs().max()), 1e-6)


def check_shapes(shapes: Iterable[tuple[int, torch.Tensor]], table: dict) -> list[str]:
    """Checks x[rows, k] @ W^T for each (rows, W) against float32, through the algorithm `table` holds for the
    shape or else algo_for's; a wrong one is replaced in `table` by the first offered algorithm that is right.
    Returns what was replaced, for the log; CappedGemmError if some shape has no right algorithm."""
    from splitserve.engine.layers import cublaslt

    replaced = []
    generator = torch.Generator(device="cpu").manual_seed(0)
    for rows, weight in shapes:
        n, k = weight.shape
        key = (rows, n, k, weight.dtype)
        x = torch.randn(rows, k, generator=generator).to(weight.device, weight.dtype)
        reference = reference_product(x, weight)
        first = table.get(key)
        errors = []
        for algo in ([first] if first is not None else []) + candidates(rows, n, k, weight.dtype):
            error = relative_error(cublaslt.lt_linear(x, weight, algo), reference)
            errors.append(round(error, 3))
            if error <= TOLERANCE:
                table[key] = algo
                if len(errors) > 1:
                    replaced.append(f"{rows}x{n}x{k}: cluster shape {algo.config.get('cluster_shape')}, "
                                    f"after {len(errors) - 1} wrong")
                break
        else:
            raise CappedGemmError(f"under the MPS SM cap ({SM_PERCENT_ENV}) no cuBLASLt algorithm computes "
                                  f"[{rows}, {k}] x [{k}, {n}] ({weight.dtype}) right: relative errors {errors}; "
                                  "run this engine without the cap")
    return replaced


def check_fp8_layers(layers: Iterable[tuple[int, torch.nn.Module]]) -> None:
    """Checks each FP8 layer's product of `rows` rows (its forward: cuBLASLt's W8A8 GEMM past the skinny kernel's
    rows) against float32 with its rows quantized as the GEMM quantizes them and its weight dequantized;
    CappedGemmError if one is wrong, as there is no other algorithm to give it here."""
    from splitserve.engine.quantization.fp8 import fp8_linear_reference

    generator = torch.Generator(device="cpu").manual_seed(0)
    for rows, layer in layers:
        n, k = layer.weight.shape
        x = torch.randn(rows, k, generator=generator)
        if layer.input_scale is not None:  # a static scale: rows inside its range, as calibrated activations are
            x *= 224 * float(layer.input_scale) / float(x.abs().max())
        x = x.to(layer.weight.device, layer.compute_dtype)
        reference = fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.input_scale, None,
                                         layer.quant.activation).float()
        error = relative_error(layer.fp8_forward(x, None), reference)
        if error > TOLERANCE:
            raise CappedGemmError(f"under the MPS SM cap ({SM_PERCENT_ENV}) the FP8 product [{rows}, {k}] x [{k}, {n}] "
                                  f"is off by {error:.3g} of its largest value; run FP8 weights without the cap")
