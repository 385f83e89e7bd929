"""Where the engine loop's time goes, step by step, under benchmarks/engine_loads.py's loads (CUDA only).

  python3 -P benchmarks/step_timeline.py --shape llama-3.1-8b --loads 256x512:256 16x2048:1 [--chunk 2048]

Every step the loop launches gets two timing events on the device, one queued before its work and
one after, and the host's time in `launch` and in completing the step before it. So for each step:
its GPU time, how long the GPU sat idle before it (waiting for the host to queue it), and the host
work around it. Summed per phase (steps with prompt chunks, steps of decodes only) for each load,
under both schedules (decodes every step, or prompts first while they fill a step) and each step
budget (--chunks), on one engine. Also: the first request after the engine is built against the same
request warm, by phase, and the runner's own prefill rate, on a fresh runner before the engine and on
the engine's runner after the loads (the same GPU, as warm as the loads left it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.bench.engine_steps import EngineUnderTest, loop_bench_config, timed
from splitserve.bench.workload import random_prompts, run_engine_batch
from splitserve.engine.checkpoints.model_shapes import write_shape_folder
from splitserve.engine.engine import Engine
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

logger = logging.getLogger("step_timeline")


@dataclasses.dataclass
class StepRecord:
    """One launched step: its shape, its events on the device, the host's time around it."""

    chunks: int
    tokens: int
    decode_rows: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    launch_s: float  # host time inside runner.launch
    schedule_s: float = 0.0  # host time planning this step
    complete_s: float = 0.0  # host time completing the step launched before it (read back, stops, outputs)
    wait_s: float = 0.0  # of which waiting for that step's tokens


class StepTimer:
    """Wraps an engine's runner.launch and _complete to record a StepRecord per step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []
        self.on = False
        self._schedule_s = 0.0
        launch, complete, schedule = engine.runner.launch, engine._complete, engine.scheduler.schedule

        def timed_schedule():
            t = time.perf_counter()
            plan = schedule()
            self._schedule_s = time.perf_counter() - t
            return plan

        def timed_launch(chunks, page_table):
            if not self.on:
                return launch(chunks, page_table)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            pending = launch(chunks, page_table)
            host = time.perf_counter() - t
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            decodes = sum(1 for c in chunks if c.length == 1 and c.start >= len(c.request.prompt_ids))
            record = StepRecord(len(chunks), sum(c.length for c in chunks), decodes, start, end, host,
                                self._schedule_s)
            self.records.append(record)
            result = pending.result

            def timed_result():
                t = time.perf_counter()
                out = result()
                if self.records:
                    self.records[-1].wait_s += time.perf_counter() - t
                return out

            pending.result = timed_result
            return pending

        def timed_complete(step):
            t = time.perf_counter()
            complete(step)
            if self.on and self.records:
                self.records[-1].complete_s += time.perf_counter() - t

        engine.runner.launch = timed_launch
        engine._complete = timed_complete
        engine.scheduler.schedule = timed_schedule

    def take(self) -> list[dict]:
        torch.cuda.synchronize()
        rows, prev_end = [], None
        for r in self.records:
            idle = max(0.0, prev_end.elapsed_time(r.start)) if prev_end is not None else 0.0
            rows.append({"chunks": r.chunks, "tokens": r.tokens, "decode_rows": r.decode_rows,
                         "gpu_ms": r.start.elapsed_time(r.end), "idle_before_ms": idle,
                         "launch_ms": r.launch_s * 1e3, "schedule_ms": r.schedule_s * 1e3,
                         "complete_ms": r.complete_s * 1e3, "wait_ms": r.wait_s * 1e3})
            prev_end = r.end
        self.records = []
        return rows


def phase_summary(rows: list[dict]) -> dict:
    """Per phase: steps, GPU ms, GPU idle ms, host ms, and medians per step."""
    out = {}
    for name, pick in (("prompt steps", lambda r: r["tokens"] > r["chunks"] or r["decode_rows"] < r["chunks"]),
                       ("decode steps", lambda r: r["tokens"] == r["chunks"] == r["decode_rows"])):
        sel = [r for r in rows if pick(r)]
        if not sel:
            continue
        out[name] = {
            "steps": len(sel), "gpu_s": sum(r["gpu_ms"] for r in sel) / 1e3,
            "idle_s": sum(r["idle_before_ms"] for r in sel) / 1e3,
            "gpu_ms_median": statistics.median(r["gpu_ms"] for r in sel),
            "idle_ms_median": statistics.median(r["idle_before_ms"] for r in sel),
            "launch_ms_median": statistics.median(r["launch_ms"] for r in sel),
            "complete_ms_median": statistics.median(r["complete_ms"] for r in sel),
            "wait_ms_median": statistics.median(r["wait_ms"] for r in sel),
            "host_ms_median": statistics.median(r["launch_ms"] + r["schedule_ms"] + r["complete_ms"] - r["wait_ms"]
                                                for r in sel),
            "decode_rows_median": statistics.median(r["decode_rows"] for r in sel),
            "tokens_median": statistics.median(r["tokens"] for r in sel),
        }
    return out


def forward_seconds(runner, batch, reps: int) -> float:
    with torch.inference_mode():
        return timed(lambda: runner.forward(batch), runner.device, reps=reps)


def runner_prefill(shape: str, tokens: int) -> dict:
    """The runner's prefill of one prompt: median of 5 runs, and of 40 back to back (clocks under load)."""
    eut = EngineUnderTest(shape, "cuda", 8, tokens + 64)
    (req,) = eut._requests(1, tokens, 1)
    batch = build_forward_batch([ScheduledChunk(req, 0, tokens, True)], eut.kv.page_table, 16, eut.device)
    short, sustained = forward_seconds(eut.runner, batch, 5), forward_seconds(eut.runner, batch, 40)
    del eut, batch
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens": tokens, "short_tok_s": tokens / short, "sustained_tok_s": tokens / sustained}


def engine_runner_prefill(engine: Engine, tokens: int) -> float:
    """Prefill tok/s of one prompt through the engine's own runner (its loop idle), as runner_prefill."""
    req = Request("runner-rate", [1] * tokens, SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
    engine.kv.admit(req, max_prefix_tokens=0)
    if not engine.kv.grow(req, tokens):
        raise MemoryError(f"no pages for {tokens} tokens")
    try:
        batch = build_forward_batch([ScheduledChunk(req, 0, tokens, True)], engine.kv.page_table,
                                    engine.cfg.page_size, engine.runner.device)
        return tokens / forward_seconds(engine.runner, batch, 20)
    finally:
        engine.kv.release(req, cache_prefix=False)


def kernel_table(fn, steps: int) -> dict:
    """GPU kernel time per step of `fn()` (which runs `steps` steps), by kernel, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    return {"kernel_ms_per_step": sum(e.device_time_total for e in events) / 1e3 / steps,
            "top": [{"name": e.key[:90], "ms_per_step": e.device_time_total / 1e3 / steps, "count": e.count}
                    for e in events[:14]]}


def prefill_kernels(engine: Engine, tokens: int) -> dict:
    """Kernel time of two one-prompt prefill steps through the engine loop and through its runner alone."""
    req = Request("runner-kernels", [1] * tokens, SamplingParams(max_new_tokens=1), on_output=lambda _o: None)
    engine.kv.admit(req, max_prefix_tokens=0)
    engine.kv.grow(req, tokens)
    try:
        batch = build_forward_batch([ScheduledChunk(req, 0, tokens, True)], engine.kv.page_table,
                                    engine.cfg.page_size, engine.runner.device)
        runner = kernel_table(lambda: forward_seconds(engine.runner, batch, 2), 4)  # 2 warm-up + 2 timed
    finally:
        engine.kv.release(req, cache_prefix=False)
    loop = kernel_table(lambda: run_engine_batch(engine, random_prompts(2, tokens, 77), 1), 2)
    return {"tokens": tokens, "runner": runner, "engine_loop": loop}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--loads", nargs="+", default=["256x512:256", "16x2048:1"])
    parser.add_argument("--chunk", type=int, default=2048, help="the engine's chunked prefill size (its warm-up)")
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="step budgets to run each load under (default: --chunk)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    loads = [tuple(int(v) for v in x.replace("x", ":").split(":")) for x in args.loads]
    report: dict = {"shape": args.shape, "chunk": args.chunk,
                    "runner_prefill": [runner_prefill(args.shape, n) for n in sorted({args.chunk, 512})]}
    logger.info("runner: %s", report["runner_prefill"])
    folder = write_shape_folder(args.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{args.shape}-")))
    kv_tokens = max(n * (p + o + 32) for n, p, o in loads)
    cfg = dataclasses.replace(loop_bench_config(folder, "cuda", 256, max(p + o for _, p, o in loads)),
                              chunked_prefill_size=args.chunk, max_total_tokens=kv_tokens)
    engine = Engine(cfg)
    timer = StepTimer(engine)
    engine.start()
    try:
        timer.on = True
        first = []
        for i in range(3):
            r = run_engine_batch(engine, random_prompts(1, 512, 1000 + i), 16)
            first.append({"prefill_s": r["prefill_s"], "decode_s": r["decode_s"], "steps": timer.take()})
        report["first_requests"] = first
        report["loads"] = []
        cases = [(load, chunk, decode_first) for load in loads for chunk in args.chunks or [args.chunk]
                 for decode_first in (True, False)]
        for (n, prompt, output), chunk, decode_first in cases:
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, decode_first=decode_first,
                                                          chunked_prefill_size=chunk)
            r = run_engine_batch(engine, random_prompts(n, prompt, n * 7 + prompt), output)
            rows = timer.take()
            row = {"load": f"{n}x{prompt}:{output}", "chunk": chunk, "decode_first": decode_first,
                   "prefill_s": r["prefill_s"], "decode_s": r["decode_s"], "ttft_p50_s": r["ttft_p50_s"],
                   "output_tok_s": n * output / (r["prefill_s"] + r["decode_s"]),
                   "prefill_tok_s": n * prompt / r["prefill_s"], "steps": len(rows),
                   "phases": phase_summary(rows), "step_rows": rows}
            report["loads"].append(row)
            logger.info("%s chunk %d decode_first=%s: prefill %.2f s (TTFT p50 %.2f s), decode %.2f s, %.0f out "
                        "tok/s; %s", row["load"], chunk, decode_first, r["prefill_s"], r["ttft_p50_s"],
                        r["decode_s"], row["output_tok_s"], json.dumps(row["phases"]))
        timer.on = False
        report["engine_runner_prefill_after"] = {n: engine_runner_prefill(engine, n)
                                                 for n in sorted({args.chunk, 512})}
        logger.info("the engine's runner after the loads: %s", report["engine_runner_prefill_after"])
        try:
            report["prefill_kernels"] = prefill_kernels(engine, args.chunk)
        except Exception:  # a profiler problem must not lose the figures above
            logger.exception("the kernel tables failed")
        for name in ("runner", "engine_loop") if "prefill_kernels" in report else ():
            table = report["prefill_kernels"][name]
            logger.info("%s: %.2f ms of kernels per %d-token prefill; top %s", name, table["kernel_ms_per_step"],
                        args.chunk, [(t["name"][:40], round(t["ms_per_step"], 2)) for t in table["top"][:8]])
    finally:
        engine.stop()
    for i, f in enumerate(report["first_requests"]):
        logger.info("request %d after build: prefill %.1f ms, decode %.1f ms; steps %s", i, f["prefill_s"] * 1e3,
                    f["decode_s"] * 1e3, [(round(s["gpu_ms"], 2), round(s["idle_before_ms"], 2),
                                           round(s["launch_ms"], 2)) for s in f["steps"][:4]])
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
