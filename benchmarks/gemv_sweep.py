"""Skinny GEMMs (decode: a few rows times a weight matrix) in Triton vs cuBLAS, per Llama shape.

  python3 -P benchmarks/gemv_sweep.py [--sweep]
  python3 -P benchmarks/gemv_sweep.py --rows 8 16 32 40 64 128 160 288 [--json OUT]   # row-invariant path's cost
Each candidate is timed inside a CUDA graph over enough weight copies to defeat the L2 cache,
so the figures are HBM-bound kernel times, not launch or cache effects. Prints, per shape and
row count, the engine's skinny kernel against cuBLAS (F.linear); with --sweep, also the best of
its launch configurations (block shapes, warps, pipeline stages), in µs and GB/s.
"""

from __future__ import annotations

import itertools
import logging
import sys

import torch

from splitserve.engine.checkpoints.model_shapes import LLAMA_3_1_8B, layer_projections
from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm
from splitserve.engine.runner.graph_timing import graph_time_us

logger = logging.getLogger("gemv_sweep")

# (name, out_features N, in_features K) of a Llama-3.1-8B layer and its LM head
SHAPES = [*layer_projections(LLAMA_3_1_8B), ("lm_head", LLAMA_3_1_8B["vocab_size"], LLAMA_3_1_8B["hidden_size"])]


def sweep_shape(name: str, n: int, k: int, m: int, configs: list[tuple[int, int, int, int]]) -> None:
    dev = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-(512 << 20) // nbytes))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, weights[0])
    cublas = graph_time_us(lambda i: torch.nn.functional.linear(x, weights[i]), copies)
    best = None
    for cfg in configs:
        try:
            got = skinny_gemm(x, weights[0], launch=cfg)
            torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=2e-2)
            us = graph_time_us(lambda i, cfg=cfg: skinny_gemm(x, weights[i], launch=cfg), copies)
        except Exception as exc:  # a configuration that does not compile or fit: skip it, say so
            logger.info("  %s m=%d %s: %s", name, m, cfg, str(exc).splitlines()[0][:100])
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    assert best is not None
    logger.info("%-8s m=%d  cuBLAS %7.2f us %5.0f GB/s | triton %7.2f us %5.0f GB/s %s | triton/cuBLAS %.3f",
                name, m, cublas, nbytes / cublas / 1e3, best[0], nbytes / best[0] / 1e3, best[1], best[0] / cublas)


def engine_kernels(m: int) -> None:
    """The engine's skinny kernel vs cuBLAS (F.linear, with its split-K reduction where it picks one)."""
    from splitserve.engine.layers import skinny

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    for name, n, k in SHAPES:
        copies = max(2, -(-(512 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=bf16) for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=bf16)
        ours = graph_time_us(lambda i, x=x, weights=weights: skinny.skinny_linear(x, weights[i]), copies)
        theirs = graph_time_us(lambda i, x=x, weights=weights: torch.nn.functional.linear(x, weights[i]), copies)
        logger.info("engine %-8s m=%-2d skinny %7.2f us (%5.0f GB/s) | cuBLAS %7.2f us (%5.0f GB/s) | ratio %.3f",
                    name, m, ours, n * k * 2 / ours / 1e3, theirs, n * k * 2 / theirs / 1e3, ours / theirs)


def row_invariant_cost(rows: list[int], layers: int = 32) -> list[dict]:
    """Per row count, the engine's row-invariant path in batch-invariant mode (engine/layers/skinny.py,
    a layer limit of 288 rows: the skinny kernel up to 32 rows, the wide-tile kernel past them) against
    cuBLAS for each shape, and one step's projections of the 8B model: `layers` x (qkv, o_proj,
    gate_up, down) + the LM head, in ms. Where the skinny kernel runs, the wide kernel is timed too
    (what one kernel for every row count would cost there)."""
    from splitserve.engine.layers import skinny
    from splitserve.engine.layers.wide_gemm_triton import row_invariant_launch, wide_gemm

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    report = []
    for m in rows:
        small = m <= skinny.SKINNY_ROWS and skinny.SKINNY_MATCHES_WIDE  # the skinny kernel's rows
        step = {"path": 0.0, "cublas": 0.0, "wide": 0.0}
        for name, n, k in SHAPES:
            copies = max(2, -(-(512 << 20) // (n * k * 2)))
            weights = [torch.randn(n, k, device=dev, dtype=bf16) for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=bf16)
            ours = graph_time_us(lambda i, x=x, weights=weights: skinny.skinny_linear(x, weights[i], max_rows=288),
                                 copies)
            theirs = graph_time_us(lambda i, x=x, weights=weights: torch.nn.functional.linear(x, weights[i]), copies)
            launch = row_invariant_launch(n, k, m)
            wide = (graph_time_us(lambda i, x=x, weights=weights, launch=launch: wide_gemm(x, weights[i], None,
                                                                                                launch), copies)
                    if small else ours)
            times = 1 if name == "lm_head" else layers
            step["path"] += times * ours / 1e3
            step["cublas"] += times * theirs / 1e3
            step["wide"] += times * wide / 1e3
            report.append({"rows": m, "shape": name, "path_us": ours, "cublas_us": theirs, "wide_us": wide,
                           "kernel": "skinny" if small else f"wide {tuple(launch)}"})
            logger.info("rows %-3d %-8s %-6s %8.2f us | cuBLAS %8.2f us | ratio %.3f%s", m, name,
                        "skinny" if small else "wide", ours, theirs, ours / theirs,
                        f" | wide {wide:8.2f} us, {wide / theirs:.3f}" if small else "")
            del weights
        report.append({"rows": m, "shape": "8b_step_ms", "path_us": step["path"], "cublas_us": step["cublas"],
                       "wide_us": step["wide"]})
        logger.info("rows %-3d one 8B step's projections: row-invariant path %.3f ms | cuBLAS %.3f ms | ratio %.3f"
                    "%s", m, step["path"], step["cublas"], step["path"] / step["cublas"],
                    f" | wide kernel {step['wide']:.3f} ms, {step['wide'] / step['cublas']:.3f}" if small else "")
    return report


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "--rows" in sys.argv:  # python3 -P benchmarks/gemv_sweep.py --rows 8 16 32 ... [--json OUT]
        args = sys.argv[sys.argv.index("--rows") + 1:]
        rows = [int(a) for a in itertools.takewhile(str.isdigit, args)]
        report = row_invariant_cost(rows)
        if "--json" in sys.argv:
            import json

            with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
                json.dump(report, f, indent=1)
        return
    for m in (1, 8, 16):
        engine_kernels(m)
    if "--sweep" in sys.argv:
        configs = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4)))
        for (name, n, k), m in itertools.product(SHAPES, (1, 8)):
            sweep_shape(name, n, k, m, configs)


if __name__ == "__main__":
    main()
