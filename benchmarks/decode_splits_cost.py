"""What the decode attention's split count costs at each batch: the fused decode kernel (as decode graphs
run it) on Llama-3.1-8B's attention shape, per batch and context, at plain decoding's count for that
batch and at the counts batch-invariant mode could fix for every batch (engine/layers/decode_splits.py).

  python3 -P benchmarks/decode_splits_cost.py [--cases 1x224 8x224 32x224 ...] [--json F]
Times are medians of CUDA-graph replays (benchmarks/attention_sweep.py's cases and timing), per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_sweep import KV_HEADS, DecodeCase, graph_us

from splitserve.engine.layers import paged_decode_triton
from splitserve.engine.layers.decode_splits import batch_invariant_splits, num_splits_for

COUNTS = (32, 16, 8, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["1x224", "8x224", "32x224", "1x1024", "8x1024", "32x1024",
                                                        "1x4096", "32x4096"], help="BATCHxCONTEXT")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    mode = batch_invariant_splits(KV_HEADS)
    rows = []
    print(f"decode attention per layer, us (batch-invariant mode's count: {mode}); {torch.cuda.get_device_name()}")
    print("batch x ctx  | plain (splits) | " + " | ".join(f"{c:>2} splits" for c in COUNTS))
    for case_text in args.cases:
        batch, ctx = (int(v) for v in case_text.split("x"))
        case = DecodeCase(batch, ctx)
        plain = num_splits_for(batch, KV_HEADS)
        times = {c: graph_us(lambda c=c, case=case: case.run(paged_decode_triton, True, splits=c))
                 for c in sorted({plain, *COUNTS})}
        rows.append({"batch": batch, "ctx": ctx, "plain_splits": plain, "us_by_splits": times})
        print(f"{batch:>5} x {ctx:<5} | {times[plain]:7.1f} ({plain:>2})   | "
              + " | ".join(f"{times[c]:9.1f}" for c in COUNTS))
        del case
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"mode_splits": mode, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
