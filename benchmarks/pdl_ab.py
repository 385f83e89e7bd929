"""Programmatic dependent launch (engine/layers/pdl.py), A B A B in one process.

  python3 -P benchmarks/pdl_ab.py --shape llama-3.1-8b --batch 1 --context 1024 [--sustain-s 4] [--output X.json]

The engine's decode graph of one bucket (decode_step_profile.build: random weights, `batch` sequences of
`context` tokens of random KV) is captured twice, without PDL and with it. Both graphs get the same inputs,
and their logits must be the same bits (PDL moves when kernels start, not what they compute). Then their
replays are timed by events in alternating rounds, each round of `reps` replays per graph; each is printed
as a ratio to its peer in the same round and to the step's sum of per-phase bounds at this run's limits
(the copy bandwidth and matmul peak measured here).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch
from decode_step_profile import build, phase_bounds, replay_times_us, sustain

from splitserve.bench.engine_steps import device_limits
from splitserve.engine.checkpoints.model_shapes import SHAPES
from splitserve.engine.layers import pdl

logger = logging.getLogger("pdl_ab")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sustain-s", type=float, default=0.0,
                        help="replay back to back this long first, so the GPU reaches its steady (power-capped) clocks")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    if not (torch.cuda.is_available() and pdl.supported(torch.device("cuda"))):
        parser.error("programmatic dependent launch needs a CUDA device of compute capability 9.0 or later")
    runner, kv, reqs = build(args.shape, args.batch, args.context)
    limits = device_limits(runner.device, runner.dtype)
    ids, positions, slots = [1] * args.batch, [args.context] * args.batch, [r.slot for r in reqs]
    graphs, logits = {}, {}
    with torch.inference_mode():
        for on in (False, True):
            pdl.install(on)
            runner.capture_decode_graphs(kv.page_table, kv.padding_slot)
            graphs[on] = runner.decode_graphs
            graphs[on].replay(ids, positions, slots)
            torch.cuda.synchronize()
            logits[on] = graphs[on].logits[args.batch].clone()
        pdl.install(False)
        same_bits = torch.equal(logits[False], logits[True])
        if not same_bits:
            raise SystemExit("the graph with PDL gave other logits than the one without it")
        replays = {on: graphs[on].graphs[args.batch].replay for on in (False, True)}
        sustained = sustain(replays[True], args.sustain_s) if args.sustain_s else 0
        rounds = []
        for _ in range(args.rounds):
            row = {}
            for on in (False, True):
                row["pdl" if on else "plain"] = statistics.median(replay_times_us(replays[on], args.reps))
            rounds.append(row)
            logger.info("round %d: plain %.0f us, pdl %.0f us", len(rounds), row["plain"], row["pdl"])
    cfg = SHAPES[args.shape]
    bounds = phase_bounds(cfg, args.batch, args.context + 1, limits["copy_bandwidth_Bps"], limits["matmul_flops"],
                          graphs[False].logits[args.batch].element_size())
    bound_us = sum(b["bound_us"] for b in bounds.values())
    plain = statistics.median(r["plain"] for r in rounds)
    with_pdl = statistics.median(r["pdl"] for r in rounds)
    report = {"shape": args.shape, "batch": args.batch, "context": args.context, "limits": limits,
              "sustained_replays": sustained, "same_bits": same_bits, "rounds": rounds, "plain_us": plain,
              "pdl_us": with_pdl, "pdl_over_plain": with_pdl / plain, "bound_us": bound_us}
    print(f"{args.shape} decode step {args.batch} x {args.context}, graph replays (median of {args.reps} a round); "
          f"limits {limits['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, {limits['matmul_flops'] / 1e12:.0f} TFLOP/s; "
          f"sum of phase bounds {bound_us:.0f} us; logits the same bits: {same_bits}")
    print("round | plain us | pdl us | pdl / plain")
    for i, r in enumerate(rounds, 1):
        print(f"{i:5d} | {r['plain']:8.0f} | {r['pdl']:6.0f} | {r['pdl'] / r['plain']:.4f}")
    print(f"median: plain {plain:.0f} us ({plain / bound_us:.3f}x the bounds), pdl {with_pdl:.0f} us "
          f"({with_pdl / bound_us:.3f}x); pdl / plain {with_pdl / plain:.4f}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
