"""Greedy output of --tp-size 2 equals --tp-size 1 on two GPUs (float32, the built-in tiny model).

  python3 -P benchmarks/tp_gpu_check.py      # on a machine with 2 GPUs; prints the verdict
"""

from __future__ import annotations

import logging
import sys

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams


def greedy(tp: int, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model="tiny", device="cuda:0", dtype="float32", tp_size=tp, page_size=4,
                                 max_total_tokens=8192, max_running_requests=8))
    engine.start()
    try:
        return generate_tokens(engine, prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    finally:
        engine.stop()


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 60, 200)]
    one, two = greedy(1, prompts), greedy(2, prompts)
    same = one == two
    print(f"TP2 vs TP1 on GPUs, {len(prompts)} prompts x 32 greedy tokens: {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
