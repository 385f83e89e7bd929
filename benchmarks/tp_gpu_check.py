"""Greedy output of --tp-size 2 equals --tp-size 1 on two GPUs (float32, the built-in tiny model).

  python3 -P benchmarks/tp_gpu_check.py      # on a machine with 2 GPUs; prints the verdict
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams


def engine(tp: int) -> Engine:
    engine = Engine(EngineConfig(model="tiny", device="cuda:0", dtype="float32", tp_size=tp, page_size=4,
                                 max_total_tokens=8192, max_running_requests=8))
    engine.start()
    return engine


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 60, 200)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        eng = engine(tp)
        started = time.monotonic()
        results[tp] = generate_tokens(eng, prompts, params)
        print(f"TP{tp}: {len(prompts)} prompts x 32 greedy tokens in {time.monotonic() - started:.2f} s", flush=True)
        if tp == 2:  # the verdict before the teardown, which is checked on its own below
            print(f"TP2 vs TP1 on GPUs: {'identical' if results[1] == results[2] else 'DIFFERENT'}", flush=True)
        stop_started = time.monotonic()
        eng.stop()
        print(f"TP{tp}: engine stopped in {time.monotonic() - stop_started:.2f} s", flush=True)
    return 0 if results[1] == results[2] else 1


if __name__ == "__main__":
    sys.exit(main())
