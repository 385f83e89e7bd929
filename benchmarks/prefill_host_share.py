"""How much of an eager prefill forward is the host's: wall time against the GPU's kernel time, per step shape.

  python3 -P benchmarks/prefill_host_share.py --shape llama-3.1-8b --steps 1x256 1x512 4x512 1x256+32x1024

A step NxI is N fresh prompts of I tokens packed in one forward (the runner alone, random weights); NxI+DxC is a
mixed step as a server under load runs it: D decode rows at C tokens of context beside those prompts. Wall is the
median of timed forwards with a synchronize after each; kernels is the sum of the CUDA kernels' durations in one
profiled forward (torch.profiler; CUPTI sees every launch). wall / kernels near 1: the GPU bounds the step; above
it, the launches do (the GPU idles between kernels) and the rate measured is the host's, not the hardware's.
The runner is warmed up first, as an engine's is: a lone prompt attends at its cuDNN bucket, and a lone prompt
that a lone-prompt CUDA graph holds (engine/runner/prompt_graphs.py, --prompt-graph-tokens) is timed through it too.
Every
step of up to --piecewise-graph-tokens tokens is also timed through the piecewise graphs
(engine/runner/piecewise_graphs.py,
captured apart from the runner, so that its forward stays the eager one): "pw" columns.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve.bench.engine_steps import EngineUnderTest, sync, timed
from splitserve.engine.runner.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger("prefill_host_share")


def kernel_seconds(fn, device: torch.device) -> float:
    """The summed duration of the CUDA kernels one call of `fn` launches."""
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6


def parse_step(text: str) -> tuple[int, int, int, int]:
    """`NxI` or `NxI+DxC` -> (prompts, tokens, decode rows, their context)."""
    prompt, _, decode = text.partition("+")
    n, tokens = (int(v) for v in prompt.split("x"))
    d, context = (int(v) for v in decode.split("x")) if decode else (0, 0)
    return n, tokens, d, context


@torch.inference_mode()
def step_row(eut: EngineUnderTest, prompts: int, tokens: int, decodes: int = 0, context: int = 0,
             piecewise: PiecewiseGraphs | None = None) -> dict:
    step = (eut.mixed_step(prompts, tokens, decodes, context) if decodes
            else eut.prefill_step(tokens, prompts))
    with step as (reqs, batch):
        wall = timed(lambda: eut.runner.forward(batch), eut.device, reps=9)
        kernels = kernel_seconds(lambda: eut.runner.forward(batch), eut.device)
        new_tokens = prompts * tokens + decodes
        row = {"step": f"{prompts}x{tokens}" + (f"+{decodes}x{context}" if decodes else ""), "wall_s": wall,
               "kernels_s": kernels, "wall_over_kernels": wall / kernels, "tok_s": new_tokens / wall,
               "tok_s_at_kernel_time": new_tokens / kernels}
        graphs = eut.runner.prompt_graphs
        if prompts == 1 and not decodes and graphs is not None and graphs.can_run(tokens):
            def replay() -> None:
                graphs.run(reqs[0].all_ids[:tokens], reqs[0].slot)

            row["graph_wall_s"] = timed(replay, eut.device, reps=9)
            row["graph_kernels_s"] = kernel_seconds(replay, eut.device)
            row["eager_over_graph"] = wall / row["graph_wall_s"]
        if piecewise is not None and piecewise.can_run(new_tokens):
            row["piecewise_bucket"] = piecewise.bucket(new_tokens)
            row["piecewise_wall_s"] = timed(lambda: piecewise.run(batch), eut.device, reps=9)
            row["piecewise_kernels_s"] = kernel_seconds(lambda: piecewise.run(batch), eut.device)
            row["eager_over_piecewise"] = wall / row["piecewise_wall_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", nargs="+", default=["1x256", "1x512", "1x1024", "1x2048", "4x512"])
    parser.add_argument("--piecewise-graph-tokens", type=int, default=1024,
                        help="steps of up to this many tokens are timed through piecewise graphs too (0: not)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        parser.error("kernel time is read from CUDA kernels: --device must be a CUDA device")
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    steps = [parse_step(s) for s in args.steps]
    eut = EngineUnderTest(args.shape, args.device, max(n + d for n, _, d, _ in steps),
                          max(n * (t + 16) + d * (c + 32) for n, t, d, c in steps) + 64)
    eut.runner.warm_up(eut.kv.page_table)  # as an engine's start: cuDNN buckets, lone-prompt graphs
    piecewise = None
    if args.piecewise_graph_tokens > 0:
        piecewise = PiecewiseGraphs(eut.runner.model, eut.runner.kv_pool, args.piecewise_graph_tokens, eut.device)
        piecewise.capture()
    rows = [step_row(eut, *step, piecewise=piecewise) for step in steps]
    print("step           | eager ms | kernels ms | wall / kernels | tok/s (eager) | tok/s at kernel time | graph ms | "
          "graph kernels ms | eager / graph | pw bucket | pw ms | pw kernels ms | eager / pw")
    for r in rows:
        graph = (f"{r['graph_wall_s'] * 1e3:8.2f} | {r['graph_kernels_s'] * 1e3:16.2f} | {r['eager_over_graph']:13.2f}"
                 if "graph_wall_s" in r else f"{'-':>8} | {'-':>16} | {'-':>13}")
        pw = (f"{r['piecewise_bucket']:9d} | {r['piecewise_wall_s'] * 1e3:5.2f} | "
              f"{r['piecewise_kernels_s'] * 1e3:13.2f} | {r['eager_over_piecewise']:10.2f}"
              if "piecewise_wall_s" in r else f"{'-':>9} | {'-':>5} | {'-':>13} | {'-':>10}")
        print(f"{r['step']:<14} | {r['wall_s'] * 1e3:8.2f} | {r['kernels_s'] * 1e3:10.2f} | "
              f"{r['wall_over_kernels']:14.2f} | {r['tok_s']:13.0f} | {r['tok_s_at_kernel_time']:20.0f} | {graph} | "
              f"{pw}")
    if args.output:
        args.output.write_text(json.dumps({"shape": args.shape, "rows": rows,
                                           "piecewise_pool_bytes": piecewise.pool_bytes if piecewise else None},
                                          indent=1))


if __name__ == "__main__":
    main()
