"""Where a decode step and a prefill spend GPU time, and where the engine loop leaves the GPU idle.

  python3 -P benchmarks/profile_engine.py --shape llama-3.1-8b [--batch 1] [--trace OUT.json]
Used to find what limits the engine benchmark; prints tables (and a chrome trace if asked).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve.bench.engine_steps import EngineUnderTest, loop_bench_config
from splitserve.bench.workload import random_prompts, run_engine_batch
from splitserve.engine.checkpoints.model_shapes import write_shape_folder
from splitserve.engine.engine import Engine
from splitserve.engine.runner.model_runner import build_forward_batch
from splitserve.engine.scheduler import ScheduledChunk

logger = logging.getLogger("profile_engine")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def runner_profile(shape: str, batch_size: int, prefill: int) -> None:
    """The model runner alone: graph replay vs eager decode, and the top kernels of each phase."""
    eut = EngineUnderTest(shape, "cuda", max(batch_size, 8), max(65536, batch_size * (1024 + 64 + 16)))
    reqs = eut._requests(batch_size, 1024, 64)
    for r in reqs:
        r.kv_len, r.output_ids = 1024, [1]
    chunks = [ScheduledChunk(r, r.kv_len, 1, True) for r in reqs]
    with torch.inference_mode():
        graphs = eut.runner.decode_graphs
        assert graphs is not None
        for label, use in (("graph", graphs), ("eager", None)):
            eut.runner.decode_graphs = use
            for _ in range(3):
                eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
            logger.info("decode batch %d %s: %.3f ms/step (host incl.)", batch_size, label,
                        (time.perf_counter() - t) / 20 * 1e3)
        eut.runner.decode_graphs = graphs
        # The GPU's share: replays back to back, no host work between them.
        bucket = next(b for b in graphs.buckets if b >= batch_size)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graphs.graphs[bucket].replay()
        torch.cuda.synchronize()
        logger.info("decode batch %d graph replay alone: %.3f ms/step", batch_size,
                    (time.perf_counter() - t) / 50 * 1e3)
        eut.runner.decode_graphs = None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        eut._release(reqs)
        (req,) = eut._requests(1, prefill, 1)
        batch = build_forward_batch([ScheduledChunk(req, 0, prefill, True)], eut.kv.page_table, 16, eut.device)
        for _ in range(2):
            eut.runner.forward(batch)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eut.runner.forward(batch)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))


def gpu_timeline(trace: dict) -> tuple[list[dict], list[dict]]:
    """The GPU activities and the host's CUDA runtime calls of a chrome trace, in time order."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    return gpu, runtime


def idle_report(gpu: list[dict], runtime: list[dict], start: float, end: float) -> dict:
    """GPU busy and idle time within [start, end] (µs), the largest gaps and what came before them."""
    busy_until, busy, gaps = start, 0.0, []
    before = "(window start)"
    for e in gpu:
        s, d = e["ts"], e["dur"]
        if s + d <= start or s >= end:
            continue
        s, f = max(s, start), min(s + d, end)
        if s > busy_until:
            gaps.append((s - busy_until, before, e["name"]))
        busy += max(0.0, f - max(s, busy_until))
        busy_until = max(busy_until, f)
        before = e["name"]
    by_kind: dict[tuple[str, str], list[float]] = defaultdict(list)
    for length, prev, nxt in gaps:
        by_kind[(prev[:60], nxt[:60])].append(length)
    top = sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:12]
    waits = [e["dur"] for e in runtime if e["name"] in ("cudaEventSynchronize", "cudaStreamSynchronize")
             and start <= e["ts"] <= end]
    launches = [e["ts"] for e in runtime if e["name"] == "cudaGraphLaunch" and start <= e["ts"] <= end]
    periods = [b - a for a, b in itertools.pairwise(launches)]
    return {"window_us": end - start, "busy_us": busy, "idle_us": end - start - busy,
            "gaps_over_5us": sum(1 for g in gaps if g[0] > 5), "steps": len(launches),
            "top_gaps": [{"after": p, "before": n, "count": len(v), "total_us": sum(v), "max_us": max(v)}
                         for (p, n), v in top],
            "host_wait_us_median": statistics.median(waits) if waits else None,
            "graph_launch_period_us_median": statistics.median(periods) if periods else None}


def loop_profile(shape: str, batch_size: int, context: int, tokens: int, trace_path: Path | None) -> None:
    """The engine loop at one batch size: step time, then a trace of where the GPU idles."""
    folder = write_shape_folder(shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{shape}-")))
    engine = Engine(loop_bench_config(folder, "cuda", max(8, batch_size), context + tokens))
    engine.start()
    try:
        run_engine_batch(engine, random_prompts(2, 32, 1), 8)
        timed = run_engine_batch(engine, random_prompts(batch_size, context, 2), tokens)
        logger.info("engine loop decode batch %d: %.3f ms/step", batch_size, timed["decode_step_s"] * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_engine_batch(engine, random_prompts(batch_size, context, 3), tokens)
        path = trace_path or Path(tempfile.mkdtemp()) / "loop_trace.json"
        prof.export_chrome_trace(str(path))
    finally:
        engine.stop()
    gpu, runtime = gpu_timeline(json.loads(path.read_text()))
    # The decode steps: the middle half of the GPU timeline (prefill and the tail left out).
    first, last = gpu[0]["ts"], gpu[-1]["ts"] + gpu[-1]["dur"]
    span = last - first
    report = idle_report(gpu, runtime, first + 0.3 * span, first + 0.8 * span)
    print(json.dumps(report, indent=1))
    per_step = report["window_us"] / max(1, report["steps"])
    logger.info("per step in the window: %.1f us wall, %.1f us GPU idle", per_step,
                report["idle_us"] / max(1, report["steps"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trace", type=Path, default=None, help="where to write the engine loop's chrome trace")
    parser.add_argument("--what", choices=["runner", "loop", "all"], default="all")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    if args.what in ("runner", "all"):
        runner_profile(args.shape, args.batch, args.prefill)
    if args.what in ("loop", "all"):
        loop_profile(args.shape, args.batch, args.context, args.tokens, args.trace)


if __name__ == "__main__":
    main()
