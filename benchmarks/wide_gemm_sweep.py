"""The wide-tile Triton GEMM's launches against cuBLAS at 64-512 rows, per Llama-3.1-8B projection.

  python3 -P benchmarks/wide_gemm_sweep.py [--rows 64 128 256 512] [--shapes qkv o_proj] [--json OUT]

The kernel is engine/layers/wide_gemm_triton.py. Each candidate is timed inside a CUDA graph over
enough weight copies to defeat the L2 cache (a decode step reads every weight from HBM), cuBLAS
(F.linear) in the same run on the same inputs; every candidate's output is checked against cuBLAS's
first. Prints per shape and row count cuBLAS's and the best launch's time and TFLOP/s and their
ratio (< 1: the Triton launch is faster). The launches are compiled first in a few processes at
once (into Triton's cache, which this process then reads).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing
import time
from pathlib import Path

import torch

from splitserve.engine.checkpoints.model_shapes import LLAMA_3_1_8B, layer_projections
from splitserve.engine.layers.wide_gemm_triton import WideLaunch, launch_fits, wide_gemm
from splitserve.engine.runner.graph_timing import graph_time_us

logger = logging.getLogger("wide_gemm_sweep")

# (name, out_features N, in_features K) of a Llama-3.1-8B layer and its LM head
SHAPES = [*layer_projections(LLAMA_3_1_8B), ("lm_head", LLAMA_3_1_8B["vocab_size"], LLAMA_3_1_8B["hidden_size"])]

# (block_m, block_n, block_k, warps, stages, split): 64-row tiles (one wgmma's M) for a fuller wave
# at 128-256 rows, 128-row tiles for more reuse per loaded byte, narrow tiles and split-K for 64 rows.
LAUNCHES = [WideLaunch(*c) for c in [
    (64, 32, 128, 4, 4, 1), (64, 64, 64, 4, 4, 1), (64, 64, 128, 4, 4, 1), (64, 128, 64, 4, 4, 1),
    (64, 128, 64, 4, 5, 1), (64, 128, 128, 4, 3, 1), (64, 256, 64, 8, 3, 1), (128, 64, 64, 4, 4, 1),
    (128, 128, 64, 4, 4, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
    (64, 64, 128, 4, 4, 2), (64, 128, 64, 4, 4, 2), (128, 128, 64, 8, 4, 2), (128, 256, 64, 8, 3, 2),
    (128, 128, 64, 8, 4, 4),
]]

def compile_launches(launches: list[WideLaunch]) -> list[str]:
    """Runs each launch once on small inputs (in a worker process), so Triton compiles and caches it;
    returns the errors of the ones that did not compile or run."""
    errors = []
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    for launch in launches:
        try:
            wide_gemm(x, w, None, launch)
            torch.cuda.synchronize()
        except Exception as exc:  # reported; the sweep skips what does not run
            errors.append(f"{tuple(launch)}: {str(exc).splitlines()[0][:160]}")
    return errors


def compile_in_parallel(launches: list[WideLaunch], workers: int) -> None:
    started = time.perf_counter()
    groups = [launches[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for errors in pool.map(compile_launches, groups):
            for e in errors:
                logger.info("compile: %s", e)
    logger.info("compiled %d launches in %d processes in %.1f s", len(launches), workers, time.perf_counter() - started)


def sweep_shape(name: str, n: int, k: int, rows: list[int], launches: list[WideLaunch]) -> list[dict]:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    copies = max(2, -(-(512 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, device=dev, dtype=bf16) / k**0.5 for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=bf16)
        ref = torch.nn.functional.linear(x, weights[0]).float()
        flops = 2 * m * n * k
        cublas = graph_time_us(lambda i, x=x: torch.nn.functional.linear(x, weights[i]), copies, reps=8)
        row = {"shape": name, "n": n, "k": k, "rows": m, "cublas_us": cublas, "cublas_tflops": flops / cublas / 1e6,
               "launches": []}
        for launch in launches:
            if not launch_fits(launch, k):
                continue
            try:
                got = wide_gemm(x, weights[0], None, launch).float()
                err = (got - ref).abs().max().item()
                torch.testing.assert_close(got, ref, atol=3e-2, rtol=2e-2)
                us = graph_time_us(lambda i, x=x, launch=launch: wide_gemm(x, weights[i], None, launch), copies, reps=8)
            except Exception as exc:  # a launch that does not compile, fit or match: skipped, said so
                logger.info("  %s m=%d %s: %s", name, m, tuple(launch), str(exc).splitlines()[0][:120])
                continue
            row["launches"].append({"launch": list(launch), "us": us, "tflops": flops / us / 1e6,
                                    "over_cublas": us / cublas, "max_abs_err_vs_cublas": err})
        best = min(row["launches"], key=lambda r: r["us"], default=None)
        row["best"] = best
        if best is None:
            logger.info("%-8s m=%-3d cuBLAS %7.2f us %4.0f TFLOP/s | no launch ran", name, m, cublas,
                        row["cublas_tflops"])
        else:
            logger.info("%-8s m=%-3d cuBLAS %7.2f us %4.0f TFLOP/s | triton %7.2f us %4.0f TFLOP/s %s | "
                        "triton/cuBLAS time %.3f", name, m, cublas, row["cublas_tflops"], best["us"], best["tflops"],
                        tuple(best["launch"]), best["over_cublas"])
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    parser.add_argument("--workers", type=int, default=8, help="processes compiling the launches first")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    if args.workers > 1:
        try:
            compile_in_parallel(LAUNCHES, args.workers)
        except Exception:  # the sweep compiles what it needs itself, one launch at a time
            logger.exception("compiling in parallel failed")
    started = time.perf_counter()
    results = []
    for name, n, k in SHAPES:
        if name in args.shapes:
            results += sweep_shape(name, n, k, args.rows, LAUNCHES)
            torch.cuda.empty_cache()  # the shape's weight copies
    logger.info("timed in %.1f s", time.perf_counter() - started)
    import triton

    measured = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
                f"{datetime.date.today().isoformat()}")
    print(f"{measured}; time ratio < 1: the Triton launch is faster")
    print("shape    | rows | cuBLAS us | cuBLAS TFLOP/s | best launch               | us      | TFLOP/s | ratio")
    for r in results:
        b = r["best"]
        print(f"{r['shape']:<8} | {r['rows']:4} | {r['cublas_us']:9.2f} | {r['cublas_tflops']:14.0f} | "
              + (f"{tuple(b['launch'])!s:<25} | {b['us']:7.2f} | {b['tflops']:7.0f} | {b['over_cublas']:.3f}"
                 if b else "none ran"))
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "results": results}, indent=1))


if __name__ == "__main__":
    main()
