"""The FP8 skinny kernel (decode rows x an e4m3 weight) against the bfloat16 one and the HBM, per Llama shape.

  python3 -P benchmarks/fp8_gemv_sweep.py [--rows 1 8] [--json OUT]

Each candidate is timed inside a CUDA graph over enough weight copies to defeat the L2 cache (as
benchmarks/gemv_sweep.py does), so the figures are HBM-bound kernel times. Per shape and row count it prints the
engine's bfloat16 skinny kernel, the FP8 kernel with the engine's launch choice and the best of a sweep of launch
configurations (block shapes, warps, pipeline stages, and how many parts K is split into: a narrow product has
few N blocks, so splitting K puts more programs, and more loads, in flight), each as GB/s of weight read over the
device-copy bandwidth measured in the same run, and fp8 / bf16 time (the bound is 0.5: half the bytes).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys

import torch

from splitserve.engine.checkpoints.model_shapes import LLAMA_3_1_8B, layer_projections
from splitserve.engine.quantization.fp8_cuda import arrival_counters, skinny_fp8, skinny_launch
from splitserve.engine.runner.graph_timing import device_copy_gbs, graph_time_us

logger = logging.getLogger("fp8_gemv_sweep")

# (name, out_features N, in_features K) of a Llama-3.1-8B layer
SHAPES = layer_projections(LLAMA_3_1_8B)
# (BLOCK_N, BLOCK_K, warps, stages, K parts): launches that compiled and ranked well unsplit, each split too.
BLOCKS = [(32, 512, 4, 4), (32, 1024, 4, 3), (64, 512, 4, 3), (64, 256, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4),
          (16, 512, 4, 4), (64, 256, 8, 3)]
CONFIGS = [(*block, splits) for block in BLOCKS for splits in (1, 2, 3, 4, 6, 8)]


def shape_report(name: str, n: int, k: int, m: int, hbm: float) -> dict:
    from splitserve.engine.layers import skinny

    dev = torch.device("cuda")
    copies = max(2, -(-(512 << 20) // (n * k)))
    w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    scale = (w16.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
    weights8 = [w8.clone() for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w8.float() * scale[:, None])
    weights16 = [w16.clone() for _ in range(max(2, -(-(512 << 20) // (n * k * 2))))]
    bf16_us = graph_time_us(lambda i: skinny.skinny_linear(x, weights16[i]), len(weights16))
    weights16.clear()  # their memory back before the FP8 copies are timed
    default = skinny_launch(n, k, x.dtype)
    results = []
    for cfg in [default, *[c for c in CONFIGS if c != default]]:
        try:
            got = skinny_fp8(x, w8, scale, launch=cfg)
            torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=2e-2)
            us = graph_time_us(lambda i, cfg=cfg: skinny_fp8(x, weights8[i], scale, launch=cfg), copies)
        except Exception as exc:  # a configuration that does not compile or fit: skip it, say so
            logger.info("  %s m=%d %s: %s", name, m, cfg, str(exc).splitlines()[0][:100])
            continue
        results.append((us, cfg))
    default_us = results[0][1] == default and results[0][0]
    # The default launch as a layer runs it: its K parts added by the last to finish (arrival counters)
    arrivals = arrival_counters(n, dev)
    layer_us = graph_time_us(lambda i: skinny_fp8(x, weights8[i], scale, launch=default, arrivals=arrivals), copies)
    best_us, best_cfg = min(results)
    gbs = n * k / best_us / 1e3
    logger.info("%-8s m=%-2d bf16 %7.2f us %5.0f GB/s | fp8 default %s %7.2f us (last part adds: %7.2f) | "
                "best %s %7.2f us %5.0f GB/s (%.2f of copy) | fp8/bf16 %.3f (default %.3f)", name, m, bf16_us,
                2 * n * k / bf16_us / 1e3,
                default, default_us or float("nan"), layer_us, best_cfg, best_us, gbs, gbs / hbm, best_us / bf16_us,
                (default_us or float("nan")) / bf16_us)
    return {"shape": name, "rows": m, "bf16_us": bf16_us, "fp8_default": list(default), "fp8_default_us": default_us,
            "fp8_default_last_adds_us": layer_us,
            "fp8_best": list(best_cfg), "fp8_best_us": best_us, "fp8_gbs": gbs, "copy_gbs": hbm,
            "top5": [[us, list(c)] for us, c in sorted(results)[:5]]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = sys.argv[1:]
    rows = [1, 8]
    if "--rows" in args:
        rows = [int(a) for a in itertools.takewhile(str.isdigit, args[args.index("--rows") + 1:])]
    hbm = device_copy_gbs()
    logger.info("device copy %.0f GB/s (%s)", hbm, torch.cuda.get_device_name())
    report = [shape_report(name, n, k, m, hbm) for m in rows for name, n, k in SHAPES]
    if "--json" in args:
        with open(args[args.index("--json") + 1], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
