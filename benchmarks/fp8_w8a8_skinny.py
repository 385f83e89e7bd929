"""W8A8 variants of the FP8 skinny kernel (e4m3 x e4m3 on the tensor cores) against the engine's, which converts
the weight to bfloat16 (W8A16), and against the bfloat16 skinny kernel, per Llama-3.1-8B shape, at decode rows:

- rows quantized inside every program (`skinny_w8a8`): measured slower than W8A16 on an H200 (docs/fp8.md);
- rows quantized once before the product, the weight on the product's wide side: the engine's decode kernel
  (`fp8_cuda.skinny_fp8_rows`), over a sweep of its launches and with the engine's own (skinny_rows_launch),
  K parts added by the last part to arrive, as in the engine. It also reports what quantizing
  the rows costs where no kernel before the product writes them (o_proj's input).

  python3 -P benchmarks/fp8_w8a8_skinny.py [--rows 1 8] [--in-kernel] [--json OUT]

(`--in-kernel`: also the variant that quantizes its rows in every program.)

Times as benchmarks/fp8_gemv_sweep.py takes them (inside a CUDA graph, over enough weight copies to defeat the
L2 cache); each figure is GB/s of weight read over this run's device-copy bandwidth, and fp8 / bf16 time (the bound
is 0.5: half the bytes). Before timing, every W8A8 configuration is checked against the prompt path's W8A8 GEMM
(quantize_rows + torch._scaled_mm) and for row invariance (a row's bits alone equal its bits among 8).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys

import torch
import triton
import triton.language as tl

from splitserve.engine.checkpoints.model_shapes import LLAMA_3_1_8B, layer_projections
from splitserve.engine.layers.pdl import launch_kwargs
from splitserve.engine.layers.pdl_triton import wait_for_previous
from splitserve.engine.quantization.fp8_cuda import (
    FP8_MAX,
    MIN_SCALE,
    TILE_ROWS,
    arrival_counters,
    quantize_rows,
    scaled_mm_linear,
    skinny_fp8,
    skinny_fp8_rows,
)
from splitserve.engine.runner.graph_timing import device_copy_gbs, graph_time_us

logger = logging.getLogger("fp8_w8a8_skinny")

SHAPES = layer_projections(LLAMA_3_1_8B)


@triton.jit
def _skinny_w8a8(X, W, WScale, XScale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym, STATIC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                 MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    m = tl.program_id(0) * 16 + tl.arange(0, 16)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = m < M
    if STATIC:
        xs = tl.zeros([16], dtype=tl.float32) + tl.load(XScale).to(tl.float32)
    else:  # per token, as quantize_rows: the row's amax over 448 (the rows are small: L2 serves the re-reads)
        amax = tl.zeros([16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & (kk < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        xs = tl.maximum(amax / FP8_MAX, MIN_SCALE)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        in_k = kk < K
        w = tl.load(W + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & in_k[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + kk[None, :], mask=rows[:, None] & in_k[None, :], other=0.0)
        xq = tl.minimum(tl.maximum(x.to(tl.float32) / xs[:, None], -FP8_MAX), FP8_MAX).to(W.dtype.element_ty)
        # Each block's product is added in float32 here: e4m3 tensor-core accumulation keeps fewer bits.
        acc += tl.dot(xq, tl.trans(w))
    scale = tl.load(WScale + n, mask=n < N, other=0.0)
    acc = acc * xs[:, None] * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows[:, None] & (n < N)[None, :])


def skinny_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """skinny_fp8 on e4m3 tensor cores: each row quantized to e4m3 in the kernel (per token, or with the static
    `input_scale`), as quantize_rows quantizes the rows of scaled_mm_linear, so no weight is converted. Row-local:
    a row's bits do not depend on the other rows."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch or (32, 512, 4, 4)
    _skinny_w8a8[(triton.cdiv(m, TILE_ROWS), triton.cdiv(n, block_n))](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        STATIC=input_scale is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=warps, num_stages=stages, **launch_kwargs())
    return y


# (BLOCK_N, BLOCK_K, warps, stages, K parts) of the pre-quantized kernel: the weight on the wide side (64 or 128
# rows of it a program), K in up to 6 parts.
WEIGHT_SIDE_BLOCKS = [(64, 256, 4, 4), (64, 512, 4, 3), (128, 256, 4, 3), (128, 128, 4, 4)]
ROWS_CONFIGS = [(*block, splits) for block in WEIGHT_SIDE_BLOCKS for splits in (1, 2, 3, 4, 6)]

CONFIGS = [(32, 512, 4, 4), (32, 1024, 4, 3), (64, 512, 4, 3), (16, 1024, 4, 4), (32, 256, 4, 4), (64, 256, 4, 4)]


def cell(name: str, n: int, k: int, m: int, hbm: float, in_kernel: bool = False) -> dict:
    from splitserve.engine.layers import skinny

    torch.manual_seed(0)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    scale = (w16.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)[:m].contiguous()
    want = scaled_mm_linear(x, w8, scale, None, None, "dynamic-token").float()
    copies16 = [w16.clone() for _ in range(max(2, -(-(512 << 20) // (n * k * 2))))]
    bf16_us = graph_time_us(lambda i: skinny.skinny_linear(x, copies16[i]), len(copies16))
    copies16.clear()
    copies8 = [w8.clone() for _ in range(max(2, -(-(512 << 20) // (n * k))))]
    arrivals16 = arrival_counters(n, x.device)  # the engine's launch: K parts added by the last to arrive
    w8a16_us = graph_time_us(lambda i: skinny_fp8(x, copies8[i], scale, arrivals=arrivals16), len(copies8))
    results = []
    for cfg in CONFIGS if in_kernel else []:
        try:
            got = skinny_w8a8(x, w8, scale, None, launch=cfg)
            torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
            alone = skinny_w8a8(x[:1].contiguous(), w8, scale, None, launch=cfg)
            assert torch.equal(alone[0], got[0]), "row 0 alone differs from row 0 among the rows"
            us = graph_time_us(lambda i, cfg=cfg: skinny_w8a8(x, copies8[i], scale, None, launch=cfg), len(copies8))
        except Exception as exc:  # one that does not compile, fit or match: say so, go on
            logger.info("  %s m=%d %s: %s", name, m, cfg, str(exc).splitlines()[0][:120])
            continue
        results.append((us, cfg))
    best_us, best = min(results) if results else (float("nan"), None)
    gbs = n * k / best_us / 1e3
    w8a16_gbs = n * k / w8a16_us / 1e3
    logger.info("%-8s m=%-2d bf16 %7.2f us | w8a16 %7.2f us (%.2f of copy), %.3f of bf16 | w8a8 in the kernel %s "
                "%7.2f us %5.0f GB/s (%.2f of copy), %.3f of bf16", name, m, bf16_us, w8a16_us, w8a16_gbs / hbm,
                w8a16_us / bf16_us, best, best_us, gbs, gbs / hbm, best_us / bf16_us)
    rows_us, rows_best, rows_all, quantize_us, engine_us = rows_cell(name, x, w8, scale, copies8, want, m)
    rows_gbs, engine_gbs = n * k / rows_us / 1e3, n * k / engine_us / 1e3
    logger.info("%-8s m=%-2d w8a8, rows quantized before: %s %7.2f us %5.0f GB/s (%.2f of copy), %.3f of bf16, %.3f "
                "of w8a16 | the engine's launch %7.2f us (%.2f of copy), %.3f of w8a16 | quantizing the rows alone "
                "%.2f us", name, m, rows_best, rows_us, rows_gbs, rows_gbs / hbm, rows_us / bf16_us,
                rows_us / w8a16_us, engine_us, engine_gbs / hbm, engine_us / w8a16_us, quantize_us)
    return {"shape": name, "rows": m, "bf16_us": bf16_us, "w8a16_us": w8a16_us, "w8a8_us": best_us,
            "w8a8_launch": best, "all": [[us, list(c)] for us, c in sorted(results)],
            "w8a8_rows_us": rows_us, "w8a8_rows_launch": rows_best, "quantize_rows_us": quantize_us,
            "rows_all": rows_all, "w8a8_rows_engine_us": engine_us}


def rows_cell(name: str, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, copies8: list[torch.Tensor],
              want: torch.Tensor, m: int) -> tuple[float, tuple | None, list, float, float]:
    """The engine's decode kernel for one cell: (best us, its launch, every launch's us, quantize_rows' us, the
    engine's launch's us with its arrival counters)."""
    xq, xs = quantize_rows(x, "dynamic-token", None)
    alone_q, alone_s = quantize_rows(x[:1].contiguous(), "dynamic-token", None)
    arrivals = arrival_counters(w8.shape[0], x.device)
    got = skinny_fp8_rows(xq, xs, w8, scale, None, x.dtype, arrivals=arrivals)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    engine_us = graph_time_us(lambda i: skinny_fp8_rows(xq, xs, copies8[i], scale, None, x.dtype, arrivals=arrivals),
                              len(copies8))
    results = []
    for cfg in ROWS_CONFIGS:
        try:
            got = skinny_fp8_rows(xq, xs, w8, scale, None, x.dtype, launch=cfg, arrivals=arrivals)
            torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
            alone = skinny_fp8_rows(alone_q, alone_s, w8, scale, None, x.dtype, launch=cfg, arrivals=arrivals)
            assert torch.equal(alone[0], got[0]), "row 0 alone differs from row 0 among the rows"
            us = graph_time_us(lambda i, cfg=cfg: skinny_fp8_rows(xq, xs, copies8[i], scale, None, x.dtype,
                                                                  launch=cfg, arrivals=arrivals), len(copies8))
        except Exception as exc:  # one that does not compile, fit or match: say so, go on
            logger.info("  %s m=%d rows %s: %s", name, m, cfg, str(exc).splitlines()[0][:120])
            continue
        results.append((us, cfg))
    quantize_us = graph_time_us(lambda _i: quantize_rows(x, "dynamic-token", None), 16)
    if not results:
        return float("nan"), None, [], quantize_us, engine_us
    best_us, best = min(results)
    return best_us, best, [[us, list(c)] for us, c in sorted(results)], quantize_us, engine_us


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = sys.argv[1:]
    rows = [1, 8]
    if "--rows" in args:
        rows = [int(a) for a in itertools.takewhile(str.isdigit, args[args.index("--rows") + 1:])]
    hbm = device_copy_gbs()
    logger.info("device copy %.0f GB/s (%s)", hbm, torch.cuda.get_device_name())
    in_kernel = "--in-kernel" in args
    report = [cell(name, n, k, m, hbm, in_kernel) for m in rows for name, n, k in SHAPES]
    if in_kernel:
        step = {m: sum(r["w8a8_us"] for r in report if r["rows"] == m) / sum(r["bf16_us"] for r in report
                                                                            if r["rows"] == m) for m in rows}
        logger.info("a layer's four products, w8a8 over bf16: %s", {m: round(v, 3) for m, v in step.items()})
    rows_step = {m: sum(r["w8a8_rows_us"] for r in report if r["rows"] == m) / sum(r["w8a16_us"] for r in report
                                                                                 if r["rows"] == m) for m in rows}
    logger.info("a layer's four products, w8a8 with rows quantized before over w8a16: %s",
                {m: round(v, 3) for m, v in rows_step.items()})
    engine_step = {m: sum(r["w8a8_rows_engine_us"] for r in report if r["rows"] == m)
                   / sum(r["w8a16_us"] for r in report if r["rows"] == m) for m in rows}
    logger.info("a layer's four products, the engine's w8a8 launches over w8a16: %s",
                {m: round(v, 3) for m, v in engine_step.items()})
    if "--json" in args:
        with open(args[args.index("--json") + 1], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
