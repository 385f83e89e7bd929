"""What the GPU's power limit leaves of its peaks when a load is held: the limits the board reports, and the
rate, SM clock and draw of back-to-back bf16 GEMMs (random and all-zero operands) and of a device copy, each held
for `--hold-s` seconds.

  python3 -P benchmarks/power_cap_probe.py --output X.json [--hold-s 10]

The serving benchmarks' ratios are to a short burst's limits, while the engine's loads run for seconds at the
H200's 700 W cap. This tells whether that cap is a setting below the board's maximum (nvidia-smi's
power.max_limit) and how far it holds each kind of work under its burst rate: a GEMM's power depends on its
operands' bits (zeros draw less), a copy is bound by HBM, not by the clock. It reads the card's state and
changes nothing (no -pl, -lgc or -ac).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from splitserve.bench.gpu_sampler import SAMPLE_FIELDS, GpuSampler, nvidia_smi_id, nvidia_smi_query, spread

logger = logging.getLogger("power_cap_probe")

LIMIT_FIELDS = ("power.limit", "power.default_limit", "power.min_limit", "power.max_limit", "enforced.power.limit",
                "clocks.max.sm")


def held(name: str, fn, work: float, seconds: float, gpu: str, calls_per_timing: int = 20) -> dict:
    """`fn` back to back for `seconds`, timed by events in groups of `calls_per_timing`: the first groups' rates
    (the burst), the median rate of the second half (held), and the clock and draw sampled over that half."""
    idle_clock, idle_draw, _ = nvidia_smi_query(gpu, SAMPLE_FIELDS)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rates: list[tuple[float, float]] = []
    with GpuSampler(gpu) as sampler:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls_per_timing):
                fn()
            end.record()
            end.synchronize()
            rates.append((time.perf_counter(), work * calls_per_timing / (begin.elapsed_time(end) / 1e3)))
    half = start + seconds / 2
    late = [s for s in sampler.samples if s[0] >= half]
    late_rates = [r for t, r in rates if t >= half]
    if not late or not late_rates:
        raise RuntimeError(f"{name}: {len(late_rates)} timed groups and {len(late)} nvidia-smi readings in the second "
                           f"half of {seconds} s ({sampler.errors} readings failed): hold longer")
    row = {"name": name, "before": {"sm_mhz": float(idle_clock), "draw_w": float(idle_draw)},
           "burst_rates": [r for _, r in rates[:3]], "held_rate": statistics.median(late_rates),
           "held_sm_mhz": spread([s[1] for s in late]), "held_draw_w": spread([s[2] for s in late]),
           "held_reasons": sorted({s[3] for s in late}), "failed_readings": sampler.errors}
    row["held_over_burst"] = row["held_rate"] / max(row["burst_rates"])
    logger.info("%s (from %s MHz, %s W): burst %s, held %.4g (%.3f of the burst), SM %s MHz, draw %s W, reasons %s",
                name, idle_clock, idle_draw, ", ".join(f"{r:.4g}" for r in row["burst_rates"]), row["held_rate"],
                row["held_over_burst"], row["held_sm_mhz"], row["held_draw_w"], row["held_reasons"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--hold-s", type=float, default=10.0)
    parser.add_argument("--rest-s", type=float, default=10.0, help="idle between loads, to leave the cap's state")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda")
    gpu = nvidia_smi_id(dev)
    limits = dict(zip(LIMIT_FIELDS, nvidia_smi_query(gpu, LIMIT_FIELDS), strict=True))
    logger.info("%s (%s): limits %s", torch.cuda.get_device_name(dev), gpu, limits)
    n = 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2))  # as init_dummy_weights
    zeros = torch.zeros_like(a)
    c = torch.empty_like(a)
    src = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    loads = [("gemm_random", lambda: torch.matmul(a, b, out=c), 2 * n**3),
             ("gemm_zeros", lambda: torch.matmul(zeros, zeros, out=c), 2 * n**3),
             ("copy", lambda: dst.copy_(src), 2 * src.numel())]  # bytes read + written
    rows = []
    for name, fn, work in loads:
        rows.append(held(name, fn, work, args.hold_s, gpu))
        time.sleep(args.rest_s)
    with open(args.output, "w") as f:
        json.dump({"gpu": gpu, "limits": limits, "hold_s": args.hold_s, "rest_s": args.rest_s, "loads": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
