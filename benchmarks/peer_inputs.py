"""Does a prefill peer's input change its rate on a power-capped GPU? The runner's packed step (four fresh
512-token prompts, as the engine loop packs them) held for seconds with prompts of one id repeated (what
an earlier EngineUnderTest sent) against random ids (what the engine loads send), alternated,
with the GPU's power and SM clock sampled through each.

  python3 -P benchmarks/peer_inputs.py [--seconds 3] [--rounds 2] [--output peer_inputs.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from splitserve.bench.engine_steps import EngineUnderTest
from splitserve.bench.gpu_sampler import GpuSampler, nvidia_smi_id

logger = logging.getLogger("peer_inputs")


def held_row(eut: EngineUnderTest, uniform: bool, seconds: float, prompts: int, tokens: int) -> dict:
    eut.uniform_ids = uniform
    with GpuSampler(nvidia_smi_id(eut.device), period_s=0.25) as sampler:
        step_s = eut.sustained_prefill_seconds(tokens, prompts, seconds)
    samples = sampler.samples
    late = samples[len(samples) // 2:] or samples  # the held half, as sustained_rate times it
    return {"ids": "one id repeated" if uniform else "random", "tok_s": prompts * tokens / step_s,
            "power_w": statistics.median(s[2] for s in late), "sm_mhz": statistics.median(s[1] for s in late)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    eut = EngineUnderTest(args.shape, "cuda", 8, 8 * 600)
    eut.runner.warm_up(eut.kv.page_table)
    rows = [held_row(eut, uniform, args.seconds, 4, 512) for _ in range(args.rounds) for uniform in (True, False)]
    print("4 x 512 packed, held | tok/s | power W | SM MHz")
    for r in rows:
        print(f"{r['ids']:<20} | {r['tok_s']:6.0f} | {r['power_w']:7.1f} | {r['sm_mhz']:6.0f}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
