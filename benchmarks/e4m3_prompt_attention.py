"""A prompt's causal attention over an FP8 KV cache: the e4m3 kernel's launches against the engine's other
paths on Llama-3.1-8B's attention shape (32/8 heads x 128), in one run, against the matmul peaks measured in it.

  python3 -P benchmarks/e4m3_prompt_attention.py [--lengths 2048 4096 8192] [--chunks 2048:6144]
                                                 [--engine-launch-only] [--json F]

For each fresh prompt's length, and each chunk after a cached prefix (the engine's cuDNN chunks), per layer:
- `cuDNN, 16-bit cache`: what a bfloat16 KV cache runs (a fresh prompt's keys and values as the projection
  wrote them, cuDNN at the engine's bucket; a chunk's over the gathered KV, cuDNN over the prefix and the chunk,
  merged);
- `cuDNN, pages widened`: `--fp8-prompt-attention off` (the e4m3 pages dequantized to bfloat16, then cuDNN);
- `e4m3 BMxBN wW sS`: the e4m3 kernel at each launch (the pages gathered and the values transposed included),
  the engine's launch marked.
TFLOP/s count the causal work (two products over the keys each row sees, times head_dim, per head); each is
also given over the measured peak of its dtype's dense matmul (bfloat16 `mm`, e4m3 `torch._scaled_mm`, 8,192
cubed) and its time over the 16-bit cuDNN's. Every side's output is checked against exact attention over the
pages first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path

import torch
from triton.testing import do_bench

from splitserve.engine.layers import e4m3_prompt_attention_triton as e4m3
from splitserve.engine.layers.extend_plan import PrefixChunk
from splitserve.engine.layers.prefix_chunk_attention import prefix_chunk_attention
from splitserve.engine.layers.prompt_attention import BUCKET_MAX
from splitserve.engine.layers.prompt_attention import lone_prompt_attention as cudnn_lone
from splitserve.engine.quantization.kv_fp8 import KVScales, quantize_kv, read_kv

HEADS, KV_HEADS, DIM = 32, 8, 128
FP8 = torch.float8_e4m3fn
# 128-row blocks take 8 warps: with 4 their float32 scores and sum spill registers (benchmarks/kernel_sass.py).
LAUNCHES = ([(128, bn, 8, s) for bn, s in itertools.product((128, 64), (2, 3, 4))]
            + [(64, 64, w, s) for w, s in itertools.product((4, 8), (2, 3, 4))])
logger = logging.getLogger("e4m3_prompt_attention")


def ms(fn) -> float:
    """Median ms of fn() (CUDA events after warm-up)."""
    return do_bench(fn, warmup=5, rep=60, return_mode="median")


def matmul_peaks(size: int = 8192) -> dict[str, float]:
    """Dense matmul TFLOP/s measured now: bfloat16 and e4m3 (row-wise scales, bf16 out), a cube of `size`."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()
    sa, sb = torch.ones(size, 1, device="cuda"), torch.ones(1, size, device="cuda")
    flops = 2 * size ** 3
    bf16 = flops / ms(lambda: a @ b) / 1e9
    fp8 = flops / ms(lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)) / 1e9
    return {"bf16": bf16, "e4m3": fp8}


def inputs(n: int):
    """A projection's q, k, v (bfloat16, the fused layout), and the same keys and values in e4m3 pages at
    scattered locations of a 2n-token cache (scale 1.0, as without checkpoint scales)."""
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=1)
    q, k, v = q.view(n, HEADS, DIM), k.view(n, KV_HEADS, DIM), v.view(n, KV_HEADS, DIM)
    ones = torch.ones(KV_HEADS, device="cuda")
    scales = KVScales(ones, ones.clone(), True)
    loc = torch.randperm(2 * n, device="cuda")[:n]
    k_cache = torch.zeros(2 * n, KV_HEADS, DIM, device="cuda", dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k_cache[loc], v_cache[loc] = quantize_kv(k, scales.k), quantize_kv(v, scales.v)
    return qkv, q, k, v, k_cache, v_cache, loc, scales


def relative_error(out: torch.Tensor, q, k_cache, v_cache, loc, check_rows: int = 256) -> float:
    """|out - exact| / |exact| over the last `check_rows` rows (float32 attention over the pages; q: the rows
    attending, the last of the loc's tokens)."""
    n, kv_len = q.shape[0], loc.shape[0]
    rows = torch.arange(max(0, n - check_rows), n, device="cuda")
    k = k_cache[loc].float().repeat_interleave(HEADS // KV_HEADS, 1)
    v = v_cache[loc].float().repeat_interleave(HEADS // KV_HEADS, 1)
    s = torch.einsum("mhd,nhd->hmn", q[rows].float(), k) * DIM ** -0.5
    visible = torch.arange(kv_len, device="cuda")[None, :] <= (kv_len - n + rows)[:, None]
    exact = torch.einsum("hmn,nhd->mhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return ((out[rows].float() - exact).norm() / exact.norm()).item()


def sweep(chunk: int, prefix: int, peaks: dict[str, float], launches: list[tuple[int, int, int, int]]) -> list[dict]:
    """The sides on `chunk` new tokens after `prefix` cached ones (0: a fresh prompt)."""
    qkv, q, k, v, k_cache, v_cache, loc, scales = inputs(prefix + chunk)
    rows = q[prefix:]
    flops = 4 * (chunk * prefix + chunk * (chunk + 1) / 2) * DIM * HEADS
    out = torch.empty_like(rows)

    def cudnn(keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
        if prefix == 0:
            return cudnn_lone(q, keys, values, DIM ** -0.5, BUCKET_MAX, projection)
        prefix_chunk_attention(rows, keys, values, PrefixChunk(0, 0, chunk, prefix, 0), DIM ** -0.5, out)
        return out

    def widened() -> torch.Tensor:
        return cudnn(read_kv(k_cache, loc, q.dtype, scales.k), read_kv(v_cache, loc, q.dtype, scales.v), None)

    sides = {"cuDNN, 16-bit cache": (lambda: cudnn(k, v, qkv), "bf16"), "cuDNN, pages widened": (widened, "bf16")}
    for launch in launches:
        name = f"e4m3 {launch[0]}x{launch[1]} w{launch[2]} s{launch[3]}" + (" (engine)" if launch == e4m3.LAUNCH
                                                                             else "")
        sides[name] = ((lambda launch=launch: e4m3.e4m3_prompt_attention(rows, k_cache, v_cache, loc, scales,
                                                                         DIM ** -0.5, launch=launch)), "e4m3")
    case = f"{chunk} after {prefix}" if prefix else f"{chunk} fresh"
    results, base = [], None
    for name, (fn, dtype) in sides.items():
        try:
            error = relative_error(fn(), rows, k_cache, v_cache, loc)
            t = ms(fn)
        except Exception as exc:  # a launch that does not fit (shared memory, registers) is reported, not fatal
            logger.info("%-16s %-30s failed: %s", case, name, str(exc).splitlines()[0][:120])
            continue
        base = base or t
        tflops = flops / t / 1e9
        row = {"case": case, "chunk": chunk, "prefix": prefix, "side": name, "ms": t, "tflops": tflops,
               "of_peak": tflops / peaks[dtype], "over_16bit_cudnn": t / base, "relative_error": error}
        results.append(row)
        logger.info("%-16s %-30s %8.3f ms %7.1f TFLOP/s %5.2f of the %s peak %6.3fx cuDNN's time  error %.4f", case,
                    name, t, tflops, row["of_peak"], dtype, row["over_16bit_cudnn"], error)
    return results


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="fresh prompts")
    parser.add_argument("--chunks", nargs="*", default=["2048:6144"],
                        help="CHUNK:PREFIX, a chunk after a cached prefix (the engine's cuDNN chunks)")
    parser.add_argument("--engine-launch-only", action="store_true", help="time only the engine's launch")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    peaks = matmul_peaks()
    logger.info("%s; dense matmul peaks now: bf16 %.0f TFLOP/s, e4m3 %.0f TFLOP/s", torch.cuda.get_device_name(),
                peaks["bf16"], peaks["e4m3"])
    launches = [e4m3.LAUNCH] if args.engine_launch_only else LAUNCHES
    cases = [(n, 0) for n in args.lengths] + [tuple(int(x) for x in c.split(":")) for c in args.chunks]
    rows = [row for chunk, prefix in cases for row in sweep(chunk, prefix, peaks, launches)]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case and r["side"].startswith("e4m3")]
        if mine:
            best = min(mine, key=lambda r: r["ms"])
            logger.info("%-16s best: %s, %.3fx the 16-bit cuDNN's time", case, best["side"], best["over_16bit_cudnn"])
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "peaks": peaks, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
