"""The bare engine under serving loads (a burst of prompts, long prompts, decode steps), each against the
bound from this run's limits.

  python3 -P benchmarks/engine_loads.py --shape llama-3.1-8b --loads 256x512:256 4x8192:1 [--chunk 2048]

A load NxI:O submits N prompts of I tokens at once, each asking for O tokens. Per load: prefill
time (to the last first token), engine-loop prefill tok/s over the runner's own prefill rate at
that prompt length (the runner's eager forward of the step the loop runs: as many such prompts as fit
the chunk, packed; measured here), and output tok/s over the bound: all
prompts at the runner's best prefill rate plus ceil(N*O / batch) - 1 decode steps at the HBM
roofline. Beside that bound, clearly apart, the same with decode steps at the roofline that counts
compute (bench/step_roofline.py: at 256 rows the projections are compute-bound). Also the first
request after the engine is built (what a client sees after /health) against the same request warm.
`--compare-triton-extend`: every load on one engine with long chunks after a prefix through the paged
extend kernel (the runner's cudnn_chunk None), then through cuDNN, then the loads that have such
chunks once more each way (the order's share). `--prefill-budgets`: one load (by default
256x512:1, whose TTFT under prompts-first is the 256x512:256 burst's) at several step token budgets.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from splitserve.bench.engine_steps import EngineUnderTest, device_limits, loop_bench_config
from splitserve.bench.step_roofline import decode_step_rooflines
from splitserve.bench.workload import random_prompts, run_engine_batch
from splitserve.engine.checkpoints.model_shapes import SHAPES, write_shape_folder
from splitserve.engine.engine import Engine

logger = logging.getLogger("engine_loads")


def parse_load(text: str) -> tuple[int, int, int]:
    n, rest = text.split("x")
    prompt, output = rest.split(":")
    return int(n), int(prompt), int(output)


def packed_prompts(prompt: int, chunk: int) -> int:
    """How many fresh prompts of `prompt` tokens the engine packs into one prefill step of `chunk` tokens."""
    return max(1, chunk // prompt)


def runner_rates(shape: str, device: str, lengths: list[int], batch: int, chunk: int, gemm_algos: str = "",
                 sustain_s: float = 0.0) -> dict:
    """The runner alone, prefill tok/s at each prompt length: `prefill_tok_s` of the step the engine runs (as many
    prompts as fit the chunk, packed: the loop's peer), `lone_prefill_tok_s` of one prompt; weights, KV bytes, limits.

    A lone prompt of a few hundred tokens is a ~12 ms forward whose eager launches can take longer than its kernels
    on the device host, so its rate swung 17k-45k tok/s from run to run at 512 tokens: no peer for a loop that
    packs four such prompts into each step."""
    eut = EngineUnderTest(shape, device, max(8, chunk // min(lengths)), max(lengths) + 64 + chunk, gemm_algos)
    limits = device_limits(eut.device, eut.runner.dtype)
    packed: dict[int, float] = {}
    lone: dict[int, float] = {}
    for _ in range(2):  # the best of two passes: a fresh GPU's clocks may still be ramping on the first
        for n in lengths:
            k = packed_prompts(n, chunk)
            packed[n] = max(packed.get(n, 0.0), k * n / eut.prefill_seconds(n, prompts=k))
            lone[n] = max(lone.get(n, 0.0), n / eut.prefill_seconds(n)) if k > 1 else packed[n]
    sustained: dict = {}
    if sustain_s > 0:  # the same limits and packed steps held for seconds: what the power cap lets them keep
        sustained = {"limits": device_limits(eut.device, eut.runner.dtype, hold_s=sustain_s), "prefill_tok_s": {
            n: packed_prompts(n, chunk) * n / eut.sustained_prefill_seconds(n, packed_prompts(n, chunk), sustain_s)
            for n in lengths}}
    out = {"limits": limits, "prefill_tok_s": packed, "lone_prefill_tok_s": lone, "sustained": sustained,
           "packed_prompts": {n: packed_prompts(n, chunk) for n in lengths}, "weight_bytes": eut.weight_bytes,
           "kv_bytes_per_token": eut.kv_bytes_per_token, "dtype_bytes": eut.runner.dtype.itemsize}
    del eut
    gc.collect()  # the runner's graphs hold it in a cycle
    torch.cuda.empty_cache()
    return out


def load_bound(n: int, prompt: int, output: int, batch: int, runner: dict, shape_cfg: dict | None = None) -> float:
    """Seconds at least: every prompt at the runner's best prefill rate, then the decode steps at the HBM
    roofline (the HBM bound), or with `shape_cfg` at the roofline that counts compute."""
    best_prefill = max(runner["prefill_tok_s"].values())
    rows = min(n, batch)
    steps = max(0, -(-n * output // rows) - 1)
    context = prompt + output / 2
    bandwidth = runner["limits"]["copy_bandwidth_Bps"]
    if shape_cfg is None:
        step_s = (runner["weight_bytes"] + rows * context * runner["kv_bytes_per_token"]) / bandwidth
    else:
        step_s = decode_step_rooflines(shape_cfg, rows, context, runner["weight_bytes"], bandwidth,
                                       runner["limits"]["matmul_flops"], runner["dtype_bytes"])["compute_s"]
    return n * prompt / best_prefill + steps * step_s


DECODE_STEPS = 64


def decode_row(engine: Engine, batch: int, context: int, runner: dict, shape_cfg: dict) -> dict:
    """Decode step time of `batch` prompts of `context` tokens through the loop (after their prefill;
    every request decodes through every timed step), against both rooflines at the mean context."""
    r = run_engine_batch(engine, random_prompts(batch, context, 7 + batch), DECODE_STEPS)
    mean_context = context + DECODE_STEPS / 2
    bandwidth = runner["limits"]["copy_bandwidth_Bps"]
    roofs = decode_step_rooflines(shape_cfg, batch, mean_context, runner["weight_bytes"], bandwidth,
                                  runner["limits"]["matmul_flops"], runner["dtype_bytes"])
    held = runner["sustained"].get("limits")
    if held:  # the compute-counting roofline at the limits a power-capped GPU holds
        sustained_s = decode_step_rooflines(shape_cfg, batch, mean_context, runner["weight_bytes"],
                                            held["copy_bandwidth_Bps"], held["matmul_flops"],
                                            runner["dtype_bytes"])["compute_s"]
    row = {"batch": batch, "context": context, "step_s": r["decode_step_s"], "hbm_roofline_s": roofs["hbm_s"],
           "step_over_hbm_roofline": r["decode_step_s"] / roofs["hbm_s"],
           "compute_counting_roofline_s": roofs["compute_s"],
           "step_over_compute_counting_roofline": r["decode_step_s"] / roofs["compute_s"], "roofline_ops": roofs["ops"]}
    if held:
        row.update(sustained_compute_counting_roofline_s=sustained_s,
                   step_over_sustained_compute_counting_roofline=r["decode_step_s"] / sustained_s)
    logger.info("decode %d x %d: %.2f ms a step, %.2fx HBM roofline, %.2fx compute-counting", batch, context,
                row["step_s"] * 1e3, row["step_over_hbm_roofline"], row["step_over_compute_counting_roofline"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--loads", nargs="+", default=["256x512:256", "64x512:256", "256x512:1", "16x2048:1",
                                                       "4x8192:1", "256x512:64"])
    parser.add_argument("--chunk", type=int, default=2048, help="chunked prefill size (tokens per step)")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--decode", nargs="*", default=[], metavar="BxC",
                        help="also decode B prompts of C tokens for 64 steps on the same engine: step time against "
                             "the HBM roofline and the one that counts compute")
    parser.add_argument("--compare-triton-extend", action="store_true",
                        help="the loads again with chunks after a prefix through the paged extend kernel")
    parser.add_argument("--prefill-budgets", type=int, nargs="*", default=[],
                        help="the --budget-load at each of these step token budgets, on the same engine")
    parser.add_argument("--budget-load", default="256x512:1")
    parser.add_argument("--gemm-algos", default="", help="the engine's --gemm-algos table (cuBLASLt algorithms per "
                        "projection shape), for the runner's rates too")
    parser.add_argument("--piecewise-graph-tokens", type=int, default=-1,
                        help="the engine's --piecewise-graph-tokens (-1: its default)")
    parser.add_argument("--sustain-s", type=float, default=0.0,
                        help="also measure the limits and the runner's packed steps held for this many seconds each "
                             "(a power-capped GPU's clocks), and every bound at those, reported beside the others")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    loads = [parse_load(x) for x in args.loads]
    sized = loads + ([parse_load(args.budget_load)] if args.prefill_budgets else [])
    lengths = sorted({p for _, p, _ in sized} | {args.chunk})
    # The runner's rates and the engine both take the table (each runner built installs its own).
    runner = runner_rates(args.shape, args.device, lengths, args.max_running, args.chunk, args.gemm_algos,
                          args.sustain_s)
    logger.info("runner prefill tok/s, the engine's packed step: %s; one prompt alone: %s",
                {k: round(v) for k, v in runner["prefill_tok_s"].items()},
                {k: round(v) for k, v in runner["lone_prefill_tok_s"].items()})
    folder = write_shape_folder(args.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{args.shape}-")))
    decodes = [tuple(int(v) for v in d.split("x")) for d in args.decode]
    per_request = max([p + o for _, p, o in sized] + [c + DECODE_STEPS for _, c in decodes])
    kv_tokens = max([n * (p + o + 32) for n, p, o in sized] + [b * (c + DECODE_STEPS + 32) for b, c in decodes])
    cfg = dataclasses.replace(loop_bench_config(folder, args.device, args.max_running, per_request),
                              chunked_prefill_size=args.chunk, max_total_tokens=kv_tokens, gemm_algos=args.gemm_algos,
                              piecewise_graph_tokens=args.piecewise_graph_tokens)
    started = time.perf_counter()
    engine = Engine(cfg)
    engine.start()
    report: dict = {"shape": args.shape, "chunk": args.chunk, "gemm_algos": args.gemm_algos,
                    "piecewise_graph_tokens": args.piecewise_graph_tokens, "runner": runner,
                    "loads": []}
    try:
        report["engine_build_s"] = time.perf_counter() - started
        first = [run_engine_batch(engine, random_prompts(1, 512, 1000 + i), 16) for i in range(3)]
        cold, warm = first[0], first[2]
        cold_s, warm_s = cold["prefill_s"] + cold["decode_s"], warm["prefill_s"] + warm["decode_s"]
        report["first_request"] = {"cold_s": cold_s, "warm_s": warm_s, "cold_over_warm": cold_s / warm_s}
        def run_load(n: int, prompt: int, output: int, variant: str) -> None:
            r = run_engine_batch(engine, random_prompts(n, prompt, n * 7 + prompt), output)
            total = r["prefill_s"] + r["decode_s"]
            bound = load_bound(n, prompt, output, args.max_running, runner)
            compute_bound = load_bound(n, prompt, output, args.max_running, runner, SHAPES[args.shape])
            row = {"load": f"{n}x{prompt}:{output}", "variant": variant,
                   "budget": engine.scheduler.config.chunked_prefill_size, "prefill_s": r["prefill_s"],
                   "total_s": total, "prefill_tok_s": n * prompt / r["prefill_s"],
                   "prefill_over_runner": n * prompt / r["prefill_s"] / runner["prefill_tok_s"][prompt],
                   "output_tok_s": n * output / total, "bound_s": bound, "output_over_bound": bound / total,
                   "compute_counting_bound_s": compute_bound,
                   "output_over_compute_counting_bound": compute_bound / total,
                   "ttft_p50_s": r.get("ttft_p50_s"), "steps": r["steps"]}
            held = runner["sustained"]
            if held:  # the same bound at the rates held for seconds, as a power-capped loop runs
                held_runner = {**runner, "limits": held["limits"], "prefill_tok_s": held["prefill_tok_s"]}
                held_bound = load_bound(n, prompt, output, args.max_running, held_runner)
                row.update(prefill_over_sustained_runner=n * prompt / r["prefill_s"] / held["prefill_tok_s"][prompt],
                           sustained_bound_s=held_bound, output_over_sustained_bound=held_bound / total)
            report["loads"].append(row)
            logger.info("%s", json.dumps(row))
            if args.output:  # as it goes: a later failure keeps what ran
                args.output.write_text(json.dumps(report, indent=1, default=str))

        cudnn_chunk = engine.runner.cudnn_chunk
        default = "cuDNN prefix chunks" if cudnn_chunk else "extend kernel"
        if args.compare_triton_extend and cudnn_chunk:
            # Extend kernel, cuDNN, then both again on the loads with chunks after a prefix (the order's share).
            passes = [(False, loads), (True, loads), *[(on, [x for x in loads if x[1] > args.chunk])
                                                      for on in (False, True)]]
            for i, (on, chosen) in enumerate(passes):
                engine.runner.cudnn_chunk = cudnn_chunk if on else None
                for n, prompt, output in chosen:
                    run_load(n, prompt, output, ("cuDNN prefix chunks" if on else "extend kernel")
                             + (" (again)" if i >= 2 else ""))
        else:
            for n, prompt, output in loads:
                run_load(n, prompt, output, default)
        budget = engine.scheduler.config.chunked_prefill_size
        for b in args.prefill_budgets:
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, chunked_prefill_size=b)
            run_load(*parse_load(args.budget_load), default)
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, chunked_prefill_size=budget)
        report["decode"] = [decode_row(engine, b, c, runner, SHAPES[args.shape]) for b, c in decodes]
    finally:
        engine.stop()
    fr = report["first_request"]
    print(f"{args.shape}, chunk {args.chunk}, max running {args.max_running}; engine built in "
          f"{report['engine_build_s']:.1f} s; first request {fr['cold_s'] * 1e3:.0f} ms, warm "
          f"{fr['warm_s'] * 1e3:.0f} ms ({fr['cold_over_warm']:.2f}x)")
    print("load          | attention of chunks after a prefix | budget | prefill s | prefill tok/s | / runner | "
          "TTFT p50 s | output tok/s | / bound (HBM) | / bound (compute-counting) | steps")
    for row in report["loads"]:
        print(f"{row['load']:<13} | {row['variant']:<34} | {row['budget']:6} | {row['prefill_s']:9.3f} | "
              f"{row['prefill_tok_s']:13.0f} | {row['prefill_over_runner']:8.3f} | {row['ttft_p50_s']:10.3f} | "
              f"{row['output_tok_s']:12.0f} | {row['output_over_bound']:13.2f} | "
              f"{row['output_over_compute_counting_bound']:26.2f} | {row['steps']}")
    held = runner["sustained"]
    if held:
        hl = held["limits"]
        print(f"held for {hl['seconds']:.0f} s each: copy {hl['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (short: "
              f"{runner['limits']['copy_bandwidth_Bps'] / 1e12:.2f}), matmul {hl['matmul_flops'] / 1e12:.0f} TFLOP/s "
              f"(short: {runner['limits']['matmul_flops'] / 1e12:.0f}); the runner's packed step "
              + ", ".join(f"{k}: {v:.0f} tok/s (short: {runner['prefill_tok_s'][k]:.0f})"
                          for k, v in held["prefill_tok_s"].items()))
        for row in report["loads"]:
            print(f"  {row['load']:<13} at the held rates: prefill / runner "
                  f"{row['prefill_over_sustained_runner']:.3f}, output / bound (HBM) "
                  f"{row['output_over_sustained_bound']:.2f}")
    for row in report.get("decode", []):
        print(f"decode {row['batch']} x {row['context']}: {row['step_s'] * 1e3:.2f} ms a step; HBM roofline "
              f"{row['hbm_roofline_s'] * 1e3:.2f} ms ({row['step_over_hbm_roofline']:.2f}x); roofline counting compute "
              f"{row['compute_counting_roofline_s'] * 1e3:.2f} ms ({row['step_over_compute_counting_roofline']:.2f}x)"
              + (f"; at the held limits {row['sustained_compute_counting_roofline_s'] * 1e3:.2f} ms "
                 f"({row['step_over_sustained_compute_counting_roofline']:.2f}x)"
                 if "sustained_compute_counting_roofline_s" in row else ""))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
