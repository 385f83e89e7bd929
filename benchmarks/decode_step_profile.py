"""One decode step of the engine's CUDA graph taken apart kernel by kernel, each against its own bound.

  python3 -P benchmarks/decode_step_profile.py --shape llama-3.1-8b --batch 256 --context 1024 [--output X.json]

The step is the graph the engine captures for its largest bucket (runner.capture_decode_graphs, with
the bucket list cut to that one bucket so start-up stays short), over `batch` sequences of `context`
tokens of random KV. The graph's replays are timed by events (the device's step, no host work), then
torch.profiler records the kernels of a few replays. Each kernel is put in the phase of the step it
belongs to by its place in the sequence (the norms, the attention kernel and the activation mark
the phase changes; whatever runs between them is that phase's projection, cuBLAS helpers included),
and every phase is set against its own bound measured in this run: max(bytes / copy bandwidth,
FLOPs / matmul peak), bytes being each input read once and each output written once. The gaps
between kernels (the device idle inside the replay) are summed per phase. With programmatic dependent
launch (the engine's default on Hopper, `--pdl`) a kernel starts while the one before it runs and waits
for it, so its span holds that wait: take the kernel table with `--pdl off`, the replay times with both.

`--gemm-variants`: each projection of the step alone at `batch` rows (CUDA-graph replays over weight
copies of at least 512 MiB), through F.linear, through cuBLASLt (torch's preferred BLAS library
switched), and against a weight stored transposed ([K, N], another cuBLAS layout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from splitserve.bench.engine_steps import device_limits, profiled_device_events, sm_clock_mhz
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_shapes import SHAPES, write_shape_folder
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.layers import pdl
from splitserve.engine.request import Request
from splitserve.engine.runner import decode_graphs as cuda_graph_runner
from splitserve.engine.runner.graph_timing import graph_time_us
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("decode_step_profile")
PROFILED_REPLAYS = 3


def phase_of_kernels(names: list[str], layers: int) -> list[str]:
    """The step's phase of each kernel of one replay, by the markers in its sequence (see the module
    docstring): inputs, norm, qkv, attention, o_proj, gate_up, activation, down, lm_head, sampling."""
    phases, current, norms = [], "inputs", 0
    for name in names:
        if "_add_rmsnorm_kernel" in name or "_rmsnorm_quantize" in name:  # FP8 rows: the norm writes e4m3
            phase = "norm"
            norms += 1
            current = "lm_head" if norms > 2 * layers else ("qkv" if norms % 2 == 1 else "gate_up")
        elif "_paged_decode" in name or "_merge_splits" in name:
            phase, current = "attention", "o_proj"
        elif "_silu_mul" in name:  # the SwiGLU kernel, or FP8's SwiGLU straight to e4m3
            phase, current = "activation", "down"
        elif "_quantize_rows" in name:
            phase = "quantize"  # an FP8 projection's activations to e4m3: their own row
        elif "_sum_splits" in name:
            phase = current + "_sum"  # an FP8 projection's second kernel (its K parts added): its own row
        elif name.startswith("Memset") or name.startswith("Memcpy"):
            phase = current  # a workspace clear or an input copy: the phase it sits in
        elif current == "lm_head" and not any(k in name.lower() for k in ("gemm", "nvjet", "xmma", "cutlass",
                                                                         "splitk", "cublas")):
            phase = current = "sampling"  # the logits' cast, the argmax, the relay write
        else:
            phase = current
        phases.append(phase)
    return phases


def phase_bounds(cfg: dict, rows: int, context: int, bandwidth: float, peak: float, logits_bytes: int,
                 weight_bytes: int = 2, kv_bytes: int = 2) -> dict[str, dict[str, float]]:
    """Per phase of one step: bytes, FLOPs and the bound in us (max of the two at this run's limits). The
    layers' projections hold `weight_bytes` a parameter (1: FP8); the LM head stays 16-bit either way. The
    KV cache holds `kv_bytes` an element (1: an FP8 cache)."""
    hidden, inter, layers, vocab = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                                    cfg["vocab_size"])
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    act = rows * hidden * 2
    out: dict[str, tuple[float, float]] = {}

    def gemm(k: int, n: int, times: int, per_param: int = weight_bytes) -> tuple[float, float]:
        return (times * (k * n * per_param + rows * k * 2 + rows * n * 2), times * 2.0 * rows * k * n)

    qkv_n = (heads + 2 * kv_heads) * head_dim
    out["qkv"] = gemm(hidden, qkv_n, layers)
    out["o_proj"] = gemm(heads * head_dim, hidden, layers)
    out["gate_up"] = gemm(hidden, 2 * inter, layers)
    out["down"] = gemm(inter, hidden, layers)
    out["lm_head"] = gemm(hidden, vocab, 1, per_param=2)
    kv_read = rows * context * 2 * kv_heads * head_dim * kv_bytes
    out["attention"] = (layers * (kv_read + rows * qkv_n * 2 + rows * heads * head_dim * 2 + rows * 2 * kv_heads
                                  * head_dim * 2), layers * 4.0 * rows * (context + 1) * heads * head_dim)
    # 2L + 1 norms: the first reads x and writes its norm; the others read x and the residual and write both
    out["norm"] = ((2 * act + 4 * act * (2 * layers)), 0.0)
    out["activation"] = (layers * rows * inter * 2 * 3, 0.0)
    out["inputs"] = (2 * act, 0.0)  # the embedding rows read and written; the index math is a few KB
    out["sampling"] = (rows * vocab * logits_bytes, 0.0)  # the argmax reads the logits once
    return {name: {"bytes": b, "flops": f, "bound_us": max(b / bandwidth, f / peak) * 1e6}
            for name, (b, f) in out.items()}


def build(shape: str, batch: int, context: int, pdl: str = "auto", quantization: str = "auto",
          sum_kernel: bool = False, kv_cache_dtype: str = "auto", fp8_decode_rows: str = "w8a8"
          ) -> tuple[ModelRunner, KVCache, list[Request]]:
    """A runner of `shape` (random weights, --pdl `pdl`, --quantization `quantization`), its KV cache holding
    `batch` sequences of `context` random tokens' KV, and the decode graph of that one bucket. `sum_kernel`:
    the FP8 layers add their K parts in a second kernel (their arrival counters dropped), for comparison.
    `kv_cache_dtype`, `fp8_decode_rows`: the engine's --kv-cache-dtype and --fp8-decode-rows."""
    folder = write_shape_folder(shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{shape}-")))
    cfg = EngineConfig(model=str(folder), device="cuda", load_format="dummy", max_running_requests=batch,
                       max_total_tokens=batch * (context + 32), context_length=16384, page_size=16,
                       cuda_graph_max_batch=batch, pdl=pdl, quantization=quantization,
                       kv_cache_dtype=kv_cache_dtype, fp8_decode_rows=fp8_decode_rows)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    buffer = runner.kv_pool.buffer  # KV of real values: zeros can time faster
    if buffer.dtype.is_floating_point and buffer.element_size() == 1:
        buffer.view(torch.uint8).random_(0, 0x7F)  # positive e4m3 bit patterns below NaN's 0x7F
    else:
        buffer.normal_()
    if sum_kernel:
        for module in runner.model.modules():
            if getattr(module, "arrivals", None) is not None:
                module.arrivals = None
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, batch, 16384, runner.device)
    reqs = []
    for i in range(batch):
        req = Request(f"profile-{i}", [1] * context, SamplingParams(max_new_tokens=8, temperature=0.0),
                      on_output=lambda _o: None)
        kv.admit(req, max_prefix_tokens=0)
        if not kv.grow(req, context + 1):
            raise MemoryError(f"KV cache too small for {batch} x {context}")
        reqs.append(req)
    cuda_graph_runner.buckets_up_to = lambda max_batch: [max_batch]  # one bucket: the one profiled
    runner.capture_decode_graphs(kv.page_table, kv.padding_slot)
    return runner, kv, reqs


def replay_times_us(replay, reps: int) -> list[float]:
    """Each replay's device time by events, after a few warm ones."""
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def sustain(replay, seconds: float) -> int:
    """Replays back to back for `seconds` (the engine's steady state: under load this GPU settles at its
    power cap's clocks, which a few replays from idle never reach); returns how many ran."""
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
        count += 10
    return count


def back_to_back_us(replay, reps: int) -> float:
    """Mean device time per replay of `reps` replays queued back to back (each one's start hidden
    behind the one before, as the engine's overlapped steps run)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def kernel_table(replay, layers: int) -> tuple[list[dict], int, dict[str, list[float]]]:
    """The kernels (name, start, duration in us) of one replay out of PROFILED_REPLAYS recorded ones,
    with their phases and the gap before each; how many kernels a replay had; each recorded replay's
    span and the idle time between them."""
    torch.cuda.synchronize()
    events = profiled_device_events(replay, PROFILED_REPLAYS)
    per_replay = len(events) // PROFILED_REPLAYS
    if per_replay * PROFILED_REPLAYS != len(events):
        logger.warning("%d device events over %d replays: not a whole number per replay", len(events),
                       PROFILED_REPLAYS)
    # Each recorded replay's span (first event's start to last event's end) and the device's idle time
    # between one replay's last event and the next one's first (queued back to back, no host wait between).
    replays = [events[i * per_replay:(i + 1) * per_replay] for i in range(PROFILED_REPLAYS)]
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays]
    between = [b[0]["ts"] - (a[-1]["ts"] + a[-1]["dur"]) for a, b in itertools.pairwise(replays)]
    logger.info("profiled replays: spans %s us, idle between them %s us, first event %s",
                [round(x) for x in spans], [round(x) for x in between], replays[-1][0]["name"][:60])
    last = events[-per_replay:]  # the last replay: warm, and its first event follows the one before it
    phases = phase_of_kernels([e["name"] for e in last], layers)
    rows = []
    for i, (e, phase) in enumerate(zip(last, phases, strict=True)):
        gap = 0.0 if i == 0 else max(0.0, e["ts"] - (last[i - 1]["ts"] + last[i - 1]["dur"]))
        rows.append({"name": e["name"], "phase": phase, "dur_us": e["dur"], "gap_before_us": gap})
    return rows, per_replay, {"spans_us": spans, "idle_between_replays_us": between}


def phase_report(kernels: list[dict], bounds: dict[str, dict[str, float]]) -> dict[str, dict]:
    report: dict[str, dict] = defaultdict(lambda: {"kernels": 0, "us": 0.0, "gap_us": 0.0, "names": {}})
    for k in kernels:
        r = report[k["phase"]]
        r["kernels"] += 1
        r["us"] += k["dur_us"]
        r["gap_us"] += k["gap_before_us"]
        short = k["name"][:90]
        r["names"][short] = r["names"].get(short, 0.0) + k["dur_us"]
    for phase, r in report.items():
        b = bounds.get(phase)
        if b:
            r.update(bound_us=b["bound_us"], over_bound=r["us"] / b["bound_us"] if b["bound_us"] else None,
                     achieved_GBps=b["bytes"] / r["us"] / 1e3, achieved_TFLOPs=b["flops"] / r["us"] / 1e6)
    return dict(report)


def projection_variants(n: int, k: int, rows: int, dtype: torch.dtype) -> dict[str, float | str]:
    """One projection [n, k] at `rows` rows: us per call through F.linear, through cuBLASLt, and with
    the weight stored [k, n]."""
    copies = max(2, -(-(512 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    row: dict[str, float | str] = {"linear_us": graph_time_us(lambda i: torch.nn.functional.linear(x, weights[i]),
                                                              copies)}
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt_us"] = graph_time_us(lambda i: torch.nn.functional.linear(x, weights[i]), copies)
    except RuntimeError as err:  # not every build has it
        row["cublaslt_error"] = str(err)[:200]
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    transposed = [w.t().contiguous() for w in weights]
    weights.clear()
    row["kn_layout_us"] = graph_time_us(lambda i: x @ transposed[i], copies)
    return row


def gemm_variants(cfg: dict, rows: int, dtype: torch.dtype) -> list[dict]:
    """Each projection of the step alone at `rows` rows (projection_variants)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (cfg["vocab_size"], hidden)}
    out = []
    for name, (n, k) in shapes.items():
        row = {"proj": name, "n": n, "k": k, "rows": rows, **projection_variants(n, k, rows, dtype)}
        row["tflops_linear"] = 2 * rows * n * k / float(row["linear_us"]) / 1e6
        out.append(row)
        torch.cuda.empty_cache()
    return out


def small_kernel_variants(cfg: dict, rows: int, dtype: torch.dtype) -> list[dict]:
    """The step's residual add + RMSNorm and SwiGLU kernels at `rows` rows under other launches: us per
    call over 64 input copies (read from HBM, not L2), against the launch fused_triton.py uses."""
    import triton

    from splitserve.engine.layers import fused_triton as ft

    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    out = []
    xs = [torch.randn(rows, hidden, dtype=dtype, device="cuda") for _ in range(64)]
    rs = [torch.randn_like(x) for x in xs]
    w = torch.ones(hidden, dtype=dtype, device="cuda")
    normed, res = torch.empty_like(xs[0]), torch.empty_like(xs[0])
    for warps in (4, 8, 16):
        us = graph_time_us(lambda i, warps=warps: ft._add_rmsnorm_kernel[(rows,)](
            xs[i], rs[i], w, normed, res, hidden, hidden, hidden, hidden, hidden, 1e-5, HAS_RESIDUAL=True,
            BLOCK=triton.next_power_of_2(hidden), num_warps=warps, PDL=False), len(xs))
        out.append({"kernel": "add_rmsnorm", "num_warps": warps, "us": us, "bytes": 4 * rows * hidden * 2})
    xs.clear()
    rs.clear()
    gus = [torch.randn(rows, 2 * inter, dtype=dtype, device="cuda") for _ in range(16)]
    act = torch.empty(rows, inter, dtype=dtype, device="cuda")
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
        us = graph_time_us(lambda i, block=block, warps=warps: ft._silu_mul_kernel[(rows, -(-inter // block))](
            gus[i], act, 2 * inter, inter, inter, BLOCK=block, num_warps=warps, PDL=False), len(gus))
        out.append({"kernel": "silu_mul", "block": block, "num_warps": warps, "us": us, "bytes": 3 * rows * inter * 2})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sustain-s", type=float, default=0.0,
                        help="replay back to back this long first, so the GPU reaches its steady (power-capped) clocks")
    parser.add_argument("--gemm-variants", action="store_true")
    parser.add_argument("--small-variants", action="store_true", help="the norm and SwiGLU kernels' launches")
    parser.add_argument("--pdl", default="auto", choices=pdl.MODES,
                        help="the engine's --pdl; with it a kernel's span in the profile includes its wait for the "
                             "kernel before it, so the kernel table reads best with off")
    parser.add_argument("--quantization", default="auto", choices=("auto", "fp8"),
                        help="fp8: the layers' projections quantized on load (the LM head stays 16-bit)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                        help="the engine's --kv-cache-dtype (fp8_e4m3: the attention reads 1 byte an element)")
    parser.add_argument("--fp8-decode-rows", default="w8a8", choices=("w8a16", "w8a8"),
                        help="the engine's --fp8-decode-rows (w8a8, its default: the decode rows quantized too)")
    parser.add_argument("--sum-kernel", action="store_true",
                        help="FP8: add the skinny kernel's K parts in a second kernel, as without arrival counters")
    parser.add_argument("--label", default="")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    cfg = SHAPES[args.shape]
    runner, _kv, reqs = build(args.shape, args.batch, args.context, args.pdl, args.quantization, args.sum_kernel,
                              args.kv_cache_dtype, args.fp8_decode_rows)
    limits = device_limits(runner.device, runner.dtype)
    graphs = runner.decode_graphs
    assert graphs is not None
    ids, positions, slots = [1] * args.batch, [args.context] * args.batch, [r.slot for r in reqs]
    with torch.inference_mode():
        graphs.replay(ids, positions, slots)  # the inputs in place; then the graph alone, no host work between
        graph = graphs.graphs[args.batch]
        sustained = sustain(graph.replay, args.sustain_s) if args.sustain_s else 0
        times = replay_times_us(graph.replay, args.reps)
        chained_us = back_to_back_us(graph.replay, args.reps)
        kernels, per_replay, replay_spans = kernel_table(graph.replay, cfg["num_hidden_layers"])
        clock = sm_clock_mhz()
    logits_bytes = graphs.logits[args.batch].element_size()
    bounds = phase_bounds(cfg, args.batch, args.context + 1, limits["copy_bandwidth_Bps"], limits["matmul_flops"],
                          logits_bytes, weight_bytes=1 if args.quantization == "fp8" else 2,
                          kv_bytes=1 if args.kv_cache_dtype == "fp8_e4m3" else 2)
    phases = phase_report(kernels, bounds)
    step_us = statistics.median(times)
    kernel_us = sum(k["dur_us"] for k in kernels)
    gap_us = sum(k["gap_before_us"] for k in kernels)
    bound_us = sum(b["bound_us"] for b in bounds.values())
    report = {"label": args.label, "pdl": args.pdl, "quantization": args.quantization,
              "fp8_decode_rows": args.fp8_decode_rows,
              "sum_kernel": args.sum_kernel, "shape": args.shape,
              "batch": args.batch, "context": args.context,
              "limits": limits, "replay_us_median": step_us, "replay_us_min": min(times), "replay_us_all": times,
              "replay_us_back_to_back": chained_us, "profiled_replays": replay_spans,
              "sustained_replays": sustained, "sm_clock_mhz_after": clock,
              "kernels_per_replay": per_replay, "kernel_us": kernel_us, "gap_us": gap_us, "bound_us": bound_us,
              "logits_element_bytes": logits_bytes, "phases": phases, "kernels": kernels}
    if args.gemm_variants:
        report["gemm_variants"] = gemm_variants(cfg, args.batch, runner.dtype)
    if args.small_variants:
        report["small_variants"] = small_kernel_variants(cfg, args.batch, runner.dtype)
    print(f"{args.label} {args.shape} decode step {args.batch} x {args.context}: graph replay {step_us:.0f} us "
          f"(min {min(times):.0f}, back to back {chained_us:.0f}; SM clock after {clock} MHz, {sustained} replays "
          f"before); kernels {kernel_us:.0f} us in {per_replay} device events, gaps {gap_us:.0f} us; "
          f"sum of bounds {bound_us:.0f} us ({step_us / bound_us:.3f}x); limits "
          f"{limits['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, {limits['matmul_flops'] / 1e12:.0f} TFLOP/s")
    print("phase      | kernels | us     | gaps us | bound us | / bound | GB/s  | TFLOP/s")
    for name, r in sorted(phases.items(), key=lambda kv: -kv[1]["us"]):
        print(f"{name:<10} | {r['kernels']:7d} | {r['us']:6.0f} | {r['gap_us']:7.0f} | {r.get('bound_us', 0):8.0f} | "
              f"{r.get('over_bound') or 0:7.3f} | {r.get('achieved_GBps', 0):5.0f} | "
              f"{r.get('achieved_TFLOPs', 0):7.0f}")
    for row in report.get("gemm_variants", []):
        print(f"{row['proj']:<8} {row['rows']} rows: F.linear {row['linear_us']:.1f} us ({row['tflops_linear']:.0f} "
              f"TFLOP/s), cuBLASLt {row.get('cublaslt_us', float('nan')):.1f} us, [K, N] weight "
              f"{row['kn_layout_us']:.1f} us")
    for row in report.get("small_variants", []):
        print(f"{row['kernel']} {row.get('block', '')} warps {row['num_warps']}: {row['us']:.2f} us, "
              f"{row['bytes'] / row['us'] / 1e3:.0f} GB/s")
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
