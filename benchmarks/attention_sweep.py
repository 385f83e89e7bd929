"""Launch configurations of the paged attention kernels on Llama-3.1-8B's attention shape (32/8
heads x 128, bf16): which tile sizes, warps and stages are fastest, against the roofline.

  python3 -P benchmarks/attention_sweep.py [--what extend decode]
Extend: TFLOP/s of the causal work (FlashAttention via SDPA, on contiguous KV, as the peer).
Decode: the KV bytes read over the kernel time against the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from splitserve.engine.layers.extend_plan import extend_plan_from, extend_plan_values
from splitserve.engine.layers.paged_decode_triton import paged_decode_attention
from splitserve.engine.layers.paged_extend_triton import paged_extend_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
DEV = torch.device("cuda")


def bench_ms(fn, *args, **kwargs) -> float:
    """Median ms of fn(*args, **kwargs) (triton's do_bench: CUDA events, after warm-up)."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=10, rep=40, return_mode="median")


def sdpa_all(qs: list[torch.Tensor], ks: list[torch.Tensor], masks: list) -> None:
    for a, b, m in zip(qs, ks, masks, strict=True):
        torch.nn.functional.scaled_dot_product_attention(a, b, b, attn_mask=m, enable_gqa=True)


def paged_kv(n: int, max_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_pages = -(-max_kv // PAGE)
    table = (torch.randperm(n * max_pages, device=DEV).view(n, max_pages) + 1).int()
    k = torch.randn(n * max_pages * PAGE + PAGE, KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
    return table, k, torch.randn_like(k)


def sweep_extend() -> None:
    cases = {"1 x 8192": ([8192], [8192]), "chunk 2048 after 6144": ([2048], [8192]), "4 x 512": ([512] * 4, [512] * 4),
             "1 x 2048": ([2048], [2048])}
    print("extend case            | tokens/prog BLOCK_N warps stages | ms     | TFLOP/s | / SDPA")
    for name, (lengths, kv_lens) in cases.items():
        table, k, v = paged_kv(len(lengths), max(kv_lens))
        q = torch.randn(sum(lengths), HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        visible = sum(sum(kv - ln + i + 1 for i in range(ln)) for ln, kv in zip(lengths, kv_lens, strict=True))
        tflop = 4 * DIM * HEADS * visible / 1e12
        ks = [torch.randn(1, KV_HEADS, kv, DIM, device=DEV, dtype=torch.bfloat16) for kv in kv_lens]
        qs = [torch.randn(1, HEADS, ln, DIM, device=DEV, dtype=torch.bfloat16) for ln in lengths]
        masks = [causal_lower_right(ln, kv) for ln, kv in zip(lengths, kv_lens, strict=True)]
        sdpa = bench_ms(sdpa_all, qs, ks, masks)
        results = []
        for tokens, block_n, warps, stages in itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3)):
            values, c, p = extend_plan_values(lengths, kv_lens, list(range(len(lengths))), tokens)
            plan = extend_plan_from(torch.tensor(values, dtype=torch.int32, device=DEV), c, p)
            try:
                ms = bench_ms(paged_extend_attention, q, k, v, table, plan, PAGE, DIM ** -0.5, out,
                              (tokens, block_n, warps, stages))
            except Exception as exc:  # out of shared memory or registers: not a candidate
                results.append((float("inf"), (tokens, block_n, warps, stages), type(exc).__name__))
                continue
            results.append((ms, (tokens, block_n, warps, stages), ""))
        results.sort()
        for ms, cfg, _ in results[:4]:
            print(f"{name:<22} | {cfg[0]:11} {cfg[1]:7} {cfg[2]:5} {cfg[3]:6} | {ms:6.3f} | {tflop / ms * 1e3:7.0f} | "
                  f"{ms / sdpa:.2f}")
        default = next(r for r in results if r[1] == (64, 128, 8, 3))
        print(f"{name:<22} | default (64, 128, 8, 3)          | {default[0]:6.3f} | "
              f"{tflop / default[0] * 1e3:7.0f} | {default[0] / sdpa:.2f}  (SDPA {sdpa:.3f} ms)")


def sweep_decode(cases: list[tuple[int, int]]) -> None:
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    copy_ms = bench_ms(buf.clone)
    bandwidth = 2 * buf.numel() / (copy_ms / 1e3)
    del buf
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print("decode batch x ctx | BLOCK_N warps stages | us     | KV GB/s | / copy bandwidth")
    for batch, ctx in cases:
        table, k, v = paged_kv(batch, ctx)
        q = torch.randn(batch, HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        slots = torch.arange(batch, device=DEV)
        lens = torch.full((batch,), ctx, device=DEV)
        kv_bytes = 2 * batch * ctx * KV_HEADS * DIM * 2
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            try:
                ms = bench_ms(paged_decode_attention, q, k, v, table, slots, lens, PAGE, DIM ** -0.5,
                              launch=(block_n, warps, stages))
            except Exception:
                continue
            results.append((ms, (block_n, warps, stages)))
        results.sort()
        for ms, cfg in results[:3] + [r for r in results if r[1] == (64, 4, 2)]:
            gbs = kv_bytes / (ms / 1e3) / 1e9
            print(f"{batch:>5} x {ctx:<10} | {cfg[0]:7} {cfg[1]:5} {cfg[2]:6} | {ms * 1e3:6.1f} | {gbs:7.0f} | "
                  f"{gbs * 1e9 / bandwidth:.2f}{'  (default)' if cfg == (64, 4, 2) else ''}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--what", nargs="+", default=["extend", "decode"], choices=["extend", "decode"])
    parser.add_argument("--decode-cases", nargs="+", default=["1x1024", "1x8192", "64x1024", "256x640", "256x1024"],
                        help="decode shapes, BATCHxCONTEXT")
    args = parser.parse_args()
    if "extend" in args.what:
        sweep_extend()
    if "decode" in args.what:
        sweep_decode([tuple(int(v) for v in c.split("x")) for c in args.decode_cases])


if __name__ == "__main__":
    main()
