"""One prompt step of the runner taken apart kernel by kernel, at full clocks and held at the power cap.

  python3 -P benchmarks/prefill_step_profile.py --shape llama-3.1-8b --steps 4x512 1x2048 [--sustain-s 6]

A step NxI is N fresh prompts of I random tokens packed in one eager forward, as the engine loop runs the
256 x 512 burst's prefill (4 x 512 a step at the default 2,048-token budget). torch.profiler records the kernels
of one forward from idle (the GPU at its full clock) and of two forwards right after `--sustain-s` seconds of
them back to back (the clock the loop's seconds of prefill run at, under the 700 W cap). Each kernel goes in the
step's phase by its place in the sequence, as in decode_step_profile.py: the norms, the RoPE + KV-store kernel,
the attention kernel and SwiGLU mark the changes, and what runs between them is that phase's projection. Every
phase is set against its bound at this run's short limits: max(bytes / copy bandwidth, FLOPs / matmul peak),
with the last layer's output projection and MLP on the sampled rows only, as the model runs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch

from splitserve.bench.engine_steps import (
    EngineUnderTest,
    device_limits,
    profiled_device_events,
    sm_clock_mhz,
    sync,
    timed,
)
from splitserve.engine.checkpoints.model_shapes import SHAPES

logger = logging.getLogger("prefill_step_profile")
ATTENTION_MARKS = ("_paged_extend", "_paged_decode", "fmha", "flash", "cudnn", "attention")


def phase_of_kernels(names: list[str], layers: int) -> list[str]:
    """Each kernel's phase: inputs, norm, qkv, rope, attention, o_proj, gate_up, activation, down, lm_head."""
    phases, current, norms = [], "inputs", 0
    for name in names:
        if "_add_rmsnorm_kernel" in name or "_rmsnorm_quantize" in name:  # FP8 rows: the norm writes e4m3
            phase = "norm"
            norms += 1
            current = "lm_head" if norms > 2 * layers else ("qkv" if norms % 2 == 1 else "gate_up")
        elif "_rope_store_kernel" in name:
            phase, current = "rope", "attention"
        elif any(mark in name.lower() for mark in ATTENTION_MARKS):
            phase, current = "attention", "o_proj"
        elif "_silu_mul" in name:  # the SwiGLU kernel, or FP8's SwiGLU straight to e4m3
            phase, current = "activation", "down"
        elif "_quantize_rows" in name:
            phase = "quantize"  # an FP8 projection's activations to e4m3: their own row
        else:
            phase = current
        phases.append(phase)
    return phases


def phase_bounds(cfg: dict, prompts: int, length: int, bandwidth: float, peak: float,
                 weight_bytes: int = 2, projection_peak: float | None = None) -> dict[str, float]:
    """Each phase's bound in us: every input read once and every output written once at the bandwidth, or its
    FLOPs at the matmul peak, whichever is longer. The last layer's o_proj and MLP run on the `prompts` sampled
    rows (LlamaForCausalLM.hidden_states). FP8 (`weight_bytes` 1, `projection_peak` the e4m3 one): the layers'
    projections read 1-byte weights at that peak; the LM head and attention stay 16-bit, at `peak`."""
    hidden, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                                    cfg["vocab_size"])
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    rows, sampled = prompts * length, prompts
    qkv_n = (heads + 2 * kv_heads) * head_dim

    def gemm(k: int, n: int, row_counts: list[int], per_param: int = weight_bytes,
             at: float = projection_peak or peak) -> tuple[float, float, float]:
        return (sum(k * n * per_param + m * (k + n) * 2 for m in row_counts),
                sum(2.0 * m * k * n for m in row_counts), at)

    after = [rows] * (layers - 1) + [sampled]
    out = {
        "qkv": gemm(hidden, qkv_n, [rows] * layers),
        "o_proj": gemm(heads * head_dim, hidden, after),
        "gate_up": gemm(hidden, 2 * inter, after),
        "down": gemm(inter, hidden, after),
        "lm_head": gemm(hidden, vocab, [sampled], per_param=2, at=peak),
        # causal: each query reads the keys up to its own position; q, k, v in, the output out
        "attention": (layers * rows * (qkv_n + heads * head_dim) * 2,
                      layers * prompts * 4.0 * heads * head_dim * length * (length + 1) / 2, peak),
        "rope": (layers * rows * (qkv_n + 2 * kv_heads * head_dim) * 2, 0.0, peak),  # q, k rotated; k, v stored
        "norm": (sum(4 * m * hidden * 2 for m in [rows] * (2 * layers - 1) + [sampled, sampled]), 0.0, peak),
        "activation": (sum(3 * m * inter * 2 for m in after), 0.0, peak),
        "inputs": (2 * rows * hidden * 2, 0.0, peak),
    }
    return {name: max(b / bandwidth, f / at) * 1e6 for name, (b, f, at) in out.items()}


def per_phase(events: list[dict], layers: int, forwards: int) -> dict[str, float]:
    """Microseconds per phase of one forward (the mean over the recorded ones), gaps between kernels apart."""
    per = len(events) // forwards
    totals: dict[str, float] = defaultdict(float)
    for i in range(forwards):
        one = events[i * per:(i + 1) * per]
        for e, phase in zip(one, phase_of_kernels([e["name"] for e in one], layers), strict=True):
            totals[phase] += e["dur"] / forwards
        span = one[-1]["ts"] + one[-1]["dur"] - one[0]["ts"]
        totals["gaps"] += (span - sum(e["dur"] for e in one)) / forwards
    return dict(totals)


def fp8_matmul_flops(device: torch.device, n: int = 8192) -> float:
    """e4m3 x e4m3 FLOP/s here: torch._scaled_mm on an n cube with row-wise scales (the engine's prompt GEMM),
    the median of a few calls after a warm one."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    seconds = timed(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device,
                    reps=5)
    return 2.0 * n**3 / seconds


@torch.inference_mode()
def profile_step(eut: EngineUnderTest, shape: str, prompts: int, length: int, sustain_s: float, limits: dict
                 ) -> dict:
    cfg = SHAPES[shape]
    layers = cfg["num_hidden_layers"]
    fp8 = "fp8_matmul_flops" in limits  # the projections at the e4m3 peak, 1 byte a weight
    bounds = phase_bounds(cfg, prompts, length, limits["copy_bandwidth_Bps"], limits["matmul_flops"],
                          weight_bytes=1 if fp8 else 2, projection_peak=limits.get("fp8_matmul_flops"))
    with eut.prefill_step(length, prompts) as (_, batch):
        def forward() -> None:
            eut.runner.forward(batch)

        wall = timed(forward, eut.device, reps=5)
        time.sleep(1.0)  # back to full clocks
        clock_idle = sm_clock_mhz()
        idle = per_phase(profiled_device_events(forward, 1), layers, 1)
        count, deadline = 0, time.monotonic() + sustain_s
        while time.monotonic() < deadline:
            for _ in range(5):
                forward()
            sync(eut.device)
            count += 5
        held_wall = timed(forward, eut.device, reps=5, warmup=0)
        clock_held = sm_clock_mhz()
        held = per_phase(profiled_device_events(forward, 2), layers, 2)
    rows = []
    for phase in sorted(set(idle) | set(held), key=lambda p: -held.get(p, 0.0)):
        bound = bounds.get(phase, 0.0)
        rows.append({"phase": phase, "idle_us": idle.get(phase, 0.0), "held_us": held.get(phase, 0.0),
                     "bound_us": bound, "held_over_bound": held.get(phase, 0.0) / bound if bound else None})
    total_held = sum(held.values())
    return {"step": f"{prompts}x{length}", "wall_s": wall, "held_wall_s": held_wall, "sustained_forwards": count,
            "sm_clock_mhz_idle": clock_idle, "sm_clock_mhz_held": clock_held, "held_kernels_us": total_held,
            "idle_kernels_us": sum(idle.values()), "bound_us": sum(bounds.values()), "phases": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--steps", nargs="+", default=["4x512", "1x2048"])
    parser.add_argument("--sustain-s", type=float, default=6.0)
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"),
                        help="fp8: the layers' projections quantized on load (the LM head stays 16-bit)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps]
    eut = EngineUnderTest(args.shape, "cuda", max(8, max(n for n, _ in steps)),
                          max(n * (length + 16) for n, length in steps) + 64, quantization=args.quantization)
    limits = device_limits(eut.device, eut.runner.dtype)
    if args.quantization == "fp8":
        limits["fp8_matmul_flops"] = fp8_matmul_flops(eut.device)
    report = {"shape": args.shape, "quantization": args.quantization,
              "device": torch.cuda.get_device_name(eut.device), "limits": limits, "steps": []}
    for n, length in steps:
        row = profile_step(eut, args.shape, n, length, args.sustain_s, limits)
        report["steps"].append(row)
        print(f"\n{row['step']}: wall {row['wall_s'] * 1e3:.2f} ms at {row['sm_clock_mhz_idle']} MHz, held "
              f"{row['held_wall_s'] * 1e3:.2f} ms at {row['sm_clock_mhz_held']} MHz ({row['sustained_forwards']} "
              f"forwards); kernels {row['idle_kernels_us'] / 1e3:.2f} / {row['held_kernels_us'] / 1e3:.2f} ms; "
              f"sum of bounds {row['bound_us'] / 1e3:.2f} ms (copy {limits['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
              f"matmul {limits['matmul_flops'] / 1e12:.0f} TFLOP/s"
              + (f", e4m3 {limits['fp8_matmul_flops'] / 1e12:.0f} TFLOP/s)" if "fp8_matmul_flops" in limits else ")"))
        print("phase       | idle us  | held us  | held share | bound us | held / bound")
        for r in row["phases"]:
            ratio = f"{r['held_over_bound']:.2f}" if r["held_over_bound"] else "-"
            print(f"{r['phase']:<11} | {r['idle_us']:8.0f} | {r['held_us']:8.0f} | "
                  f"{r['held_us'] / row['held_kernels_us']:10.3f} | {r['bound_us']:8.0f} | {ratio}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
