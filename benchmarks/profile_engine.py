"""Where a decode step and a prefill spend GPU time: top kernels from torch.profiler.

  python -m splitserve ... (run as: python3 -P benchmarks/profile_engine.py --shape llama-3.1-8b)
Used to find what limits the engine benchmark; prints tables, writes nothing.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve.engine.bench_engine import EngineUnderTest
from splitserve.engine.model_runner import build_forward_batch
from splitserve.engine.scheduler import ScheduledChunk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=2048)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    eut = EngineUnderTest(args.shape, "cuda", max(args.batch, 8), 65536)
    reqs = eut._requests(args.batch, 1024, 64)
    for r in reqs:
        r.kv_len, r.output_ids = 1024, [1]
    chunks = [ScheduledChunk(r, r.kv_len, 1, True) for r in reqs]
    with torch.inference_mode():
        graphs = eut.runner.decode_graphs
        for label, use in (("graph", graphs), ("eager", None)):
            eut.runner.decode_graphs = use
            for _ in range(3):
                eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
            print(f"decode batch {args.batch} {label}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms/step (host incl.)")
        graphs = eut.runner.decode_graphs = eut.runner.decode_graphs or graphs
        # The GPU's share: replays back to back, no host work between them.
        bucket = next(b for b in graphs.buckets if b >= args.batch)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graphs.graphs[bucket].replay()
        torch.cuda.synchronize()
        print(f"decode batch {args.batch} graph replay alone: {(time.perf_counter() - t) / 50 * 1e3:.2f} ms/step")
        eut.runner.decode_graphs = None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eut.runner.run(chunks, eut.kv.page_table)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        eut._release(reqs)
        (req,) = eut._requests(1, args.prefill, 1)
        batch = build_forward_batch([ScheduledChunk(req, 0, args.prefill, True)], eut.kv.page_table, 16, eut.device)
        for _ in range(2):
            eut.runner.forward(batch)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eut.runner.forward(batch)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))


if __name__ == "__main__":
    main()
