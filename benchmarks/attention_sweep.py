"""Launch configurations of the paged attention kernels on Llama-3.1-8B's attention shape (32/8
heads x 128, bf16): which tile sizes, warps, stages and split counts are fastest, against the
roofline, and against another checkout's kernels measured in the same run.

  python3 -P benchmarks/attention_sweep.py [--what extend decode] [--baseline /path/to/checkout] [--json F]
Decode: the KV bytes read over the kernel time (CUDA-graph replays, as the engine runs it) against
the measured copy bandwidth; fused (the step's new token rotated, stored and attended in the kernel,
as decode graphs run it) and plain (the KV already stored, as mixed steps' decode rows run it).
Extend: TFLOP/s of the causal work; the peers are SDPA per prompt (the runner's path for a fresh
prompt) and FlashAttention's varlen kernel over all prompts at once where this torch has it; a chunk
after a prefix also through the cuDNN path (engine/layers/prefix_chunk_attention.py: the KV gathered,
two cuDNN calls, the merge), with its first call's time (cuDNN builds a graph per shape) and its
largest difference from the extend kernel's output.
`--baseline`: a splitserve checkout (e.g. main's) whose two kernel files are loaded and timed on the
same inputs at their default launch.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import time
from pathlib import Path
from types import ModuleType

import torch
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from splitserve.engine.layers import paged_decode_triton, paged_extend_triton
from splitserve.engine.layers.decode_splits import num_splits_for
from splitserve.engine.layers.extend_plan import PrefixChunk, block_tokens, extend_plan_from, extend_plan_values
from splitserve.engine.layers.prefix_chunk_attention import prefix_chunk_attention
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.engine.quantization.kv_fp8 import KVScales
from splitserve.engine.runner.model_runner import kv_locations

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
TABLE_WIDTH = 1024  # pages per slot, as the engine's table at a 16k context (Triton specializes on it)
DEV = torch.device("cuda")
# name -> (new tokens per prompt, KV length per prompt after the step)
EXTEND_CASES = {"1 x 8192": ([8192], [8192]), "chunk 2048 after 6144": ([2048], [8192]),
                "chunk 2048 after 4096": ([2048], [6144]), "chunk 2048 after 2048": ([2048], [4096]),
                "chunk 1024 after 1024": ([1024], [2048]), "chunk 1024 after 7168": ([1024], [8192]),
                "chunk 512 after 1536": ([512], [2048]), "chunk 512 after 7680": ([512], [8192]),
                "chunk 2048 after 512": ([2048], [2560]),
                "4 x 512": ([512] * 4, [512] * 4), "2 x 2048": ([2048] * 2, [2048] * 2)}
logger = logging.getLogger("attention_sweep")


def bench_ms(fn, *args, **kwargs) -> float:
    """Median ms of fn(*args, **kwargs) (triton's do_bench: CUDA events, after warm-up)."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=10, rep=40, return_mode="median")


def graph_us(fn, calls: int = 10, replays: int = 7) -> float:
    """Median us per call of `fn()` captured `calls` times into one CUDA graph (no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_bandwidth() -> float:
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    seconds = bench_ms(buf.clone) / 1e3
    del buf
    return 2 * (1 << 30) / seconds


def paged_kv(n: int, max_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A page table of TABLE_WIDTH pages per slot, each sequence on its own shuffled pages, and K/V pools."""
    pages = -(-max_kv // PAGE)
    table = torch.zeros(n, TABLE_WIDTH, dtype=torch.int32, device=DEV)
    table[:, :pages] = (torch.randperm(n * pages, device=DEV).view(n, pages) + 1).int()
    k = torch.randn(n * pages * PAGE + PAGE, KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
    return table, k, torch.randn_like(k)


class DecodeCase:
    """Inputs of one decode step of `batch` sequences at `ctx` tokens, laid out as the engine's are."""

    def __init__(self, batch: int, ctx: int, fp8: bool = False) -> None:
        self.batch, self.ctx = batch, ctx
        self.table, self.k, self.v = paged_kv(batch, ctx)
        self.scales = None
        if fp8:  # an FP8 cache: e4m3 pages, the scale 1.0 the engine uses without checkpoint scales
            self.k, self.v = (t.clamp(-448, 448).to(torch.float8_e4m3fn) for t in (self.k, self.v))
            ones = torch.ones(KV_HEADS, device=DEV)
            self.scales = KVScales(ones, ones.clone())
        qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * DIM, device=DEV, dtype=torch.bfloat16)
        q, k_new, v_new = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        self.q, self.k_new, self.v_new = (t.view(batch, -1, DIM) for t in (q, k_new, v_new))
        self.slots = torch.arange(batch, device=DEV)
        self.lens = torch.full((batch,), ctx, device=DEV)
        pos = self.lens - 1
        self.loc = self.table[self.slots, pos // PAGE].long() * PAGE + pos % PAGE
        self.rope = RotaryEmbedding(DIM, 16384, 500000.0, None).to(DEV)
        self.kv_bytes = 2 * batch * ctx * KV_HEADS * DIM * self.k.element_size()

    def run(self, module: ModuleType, fused: bool, **kwargs) -> torch.Tensor:
        new = module.NewTokenKV(self.k_new, self.v_new, self.rope.cos, self.rope.sin, self.loc) if fused else None
        if self.scales is not None:
            kwargs["scales"] = self.scales
        return module.paged_decode_attention(self.q, self.k, self.v, self.table, self.slots, self.lens, PAGE,
                                             DIM ** -0.5, new, **kwargs)


def decode_configs() -> list[tuple[int, int, int, bool]]:
    """(BLOCK_N, warps, stages, heads first): around the last sweep's best (64 keys, 4 warps, 3 stages)."""
    around = [*itertools.product((64,), (4,), (2, 3, 4), (False, True)), *itertools.product((128,), (4,), (2, 3),
                                                                                              (False, True))]
    return [*around, (32, 4, 2, False), (32, 4, 3, False), (64, 8, 3, False), (64, 2, 3, False),
            (128, 8, 3, False), (128, 4, 4, False), (256, 8, 2, False), (256, 8, 3, False)]


def decode_us(case: DecodeCase, module: ModuleType, fused: bool, **kwargs) -> float:
    return graph_us(lambda: case.run(module, fused, **kwargs))


def sweep_decode(cases: list[tuple[int, int]], baseline: ModuleType | None, bandwidth: float,
                 fp8: bool = False) -> list[dict]:
    rows = []
    print("decode batch x ctx | kernel    fused splits | BLOCK_N warps stages heads-first | us     | KV GB/s | "
          "/ copy bandwidth")

    def record(case: DecodeCase, kernel: str, fused: bool, splits: int, launch, us: float) -> dict:
        gbs = case.kv_bytes / (us / 1e6) / 1e9
        row = {"batch": case.batch, "ctx": case.ctx, "kernel": kernel, "fused": fused, "splits": splits,
               "launch": list(launch) if launch else None, "us": us, "kv_GBps": gbs, "of_copy": gbs * 1e9 / bandwidth}
        rows.append(row)
        return row

    def show(row: dict, note: str = "") -> None:
        launch = " ".join(f"{v!s:>5}" for v in row["launch"]) if row["launch"] else "default"
        print(f"{row['batch']:>5} x {row['ctx']:<10} | {row['kernel']:<9} {row['fused']!s:<5} {row['splits']:6} | "
              f"{launch:<32} | {row['us']:6.1f} | {row['kv_GBps']:7.0f} | {row['of_copy']:.2f} {note}")

    for batch, ctx in cases:
        case = DecodeCase(batch, ctx, fp8)
        default_splits = num_splits_for(batch, KV_HEADS)
        for fused in (True, False):
            if baseline is not None:
                show(record(case, "baseline", fused, default_splits, None,
                            decode_us(case, baseline, fused, splits=default_splits)), "(baseline default)")
            default = paged_decode_triton.decode_launch(default_splits, DIM)
            configs = decode_configs() if fused else [default]
            tried = []
            for cfg in configs:
                try:
                    us = decode_us(case, paged_decode_triton, fused, launch=cfg, splits=default_splits)
                except Exception as exc:  # out of shared memory or registers: not a candidate
                    logger.info("decode %s failed: %s", cfg, type(exc).__name__)
                    continue
                tried.append(record(case, "new", fused, default_splits, cfg, us))
            tried.sort(key=lambda r: r["us"])
            for r in tried[:3]:
                show(r)
            for r in tried:
                if tuple(r["launch"]) == default:
                    show(r, "(default)")
            if fused and default_splits == 1:  # more, shorter programs (and a merge) instead of one per sequence
                for r, splits in itertools.product(tried[:2], (2, 4)):
                    cfg = tuple(r["launch"])
                    us = decode_us(case, paged_decode_triton, True, launch=cfg, splits=splits)
                    show(record(case, "new", True, splits, cfg, us))
        del case
        torch.cuda.empty_cache()
    return rows


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> None:
    torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=DIM ** -0.5)


def cudnn_split_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, length: int, kv_len: int,
                   out: torch.Tensor, name: str) -> float:
    """ms of one chunk through the cuDNN path, as PagedAttention runs it (the gather included); logs its first
    call's time and its largest difference from the extend kernel's rows."""
    chunk = PrefixChunk(0, 0, length, kv_len - length, 0)
    loc = kv_locations(table.long(), 0, kv_len, PAGE)

    def run() -> None:
        prefix_chunk_attention(q, k[loc], v[loc], chunk, DIM ** -0.5, out)

    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - started) * 1e3
    got = out.clone()
    tokens = block_tokens(HEADS // KV_HEADS, False)
    values, c, p = extend_plan_values([length], [kv_len], [0], tokens)
    plan = extend_plan_from(torch.tensor(values, dtype=torch.int32, device=DEV), c, p)
    want = paged_extend_triton.paged_extend_attention(q, k, v, table, plan, PAGE, DIM ** -0.5,
                                                      torch.empty_like(out))
    diff = float((got.float() - want.float()).abs().max())
    print(f"{name:<22} | cuDNN split first call {first_ms:.1f} ms; max |cuDNN split - extend kernel| {diff:.2e}")
    return bench_ms(run)


def sweep_extend(baseline: ModuleType | None, stage_variants: bool = False) -> list[dict]:
    tokens = block_tokens(HEADS // KV_HEADS, False)
    rows = []
    print("extend case            | kernel     tokens/prog BLOCK_N warps stages | ms     | TFLOP/s | / SDPA per prompt")
    for name, (lengths, kv_lens) in EXTEND_CASES.items():
        table, k, v = paged_kv(len(lengths), max(kv_lens))
        # Queries as the engine's: a view of the step's qkv projection.
        qkv = torch.randn(sum(lengths), (HEADS + 2 * KV_HEADS) * DIM, device=DEV, dtype=torch.bfloat16)
        q = qkv[:, :HEADS * DIM].view(-1, HEADS, DIM)
        out = torch.empty(q.shape, dtype=q.dtype, device=DEV)
        visible = sum(sum(kv - ln + i + 1 for i in range(ln)) for ln, kv in zip(lengths, kv_lens, strict=True))
        tflop = 4 * DIM * HEADS * visible / 1e12
        fresh = lengths == kv_lens
        qs = [torch.randn(1, HEADS, ln, DIM, device=DEV, dtype=torch.bfloat16) for ln in lengths]
        ks = [torch.randn(1, KV_HEADS, kv, DIM, device=DEV, dtype=torch.bfloat16) for kv in kv_lens]
        masks = [None if fresh else causal_lower_right(ln, kv) for ln, kv in zip(lengths, kv_lens, strict=True)]

        def sdpa_all(qs=qs, ks=ks, masks=masks, fresh=fresh) -> None:
            for a, b, m in zip(qs, ks, masks, strict=True):
                torch.nn.functional.scaled_dot_product_attention(a, b, b, attn_mask=m, is_causal=fresh,
                                                                 enable_gqa=True)

        sdpa = bench_ms(sdpa_all)
        values, c, p = extend_plan_values(lengths, kv_lens, list(range(len(lengths))), tokens)
        plan = extend_plan_from(torch.tensor(values, dtype=torch.int32, device=DEV), c, p)
        timed: list[tuple[str, str, float]] = [("SDPA", "per prompt", sdpa)]
        if fresh:  # FlashAttention's varlen kernel over the step's prompts at once (contiguous KV)
            flat_q = torch.randn(sum(lengths), HEADS, DIM, device=DEV, dtype=torch.bfloat16)
            flat_k = torch.randn(sum(lengths), KV_HEADS, DIM, device=DEV, dtype=torch.bfloat16)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
            try:
                timed.append(("flash varlen", "", bench_ms(flash_varlen, flat_q, flat_k, flat_k, cu, max(lengths))))
            except Exception as exc:  # this torch's build or signature lacks it
                logger.info("flash varlen unavailable: %s", str(exc).splitlines()[0])
        if baseline is not None:
            timed.append(("baseline", "default", bench_ms(baseline.paged_extend_attention, q, k, v, table, plan, PAGE,
                                                          DIM ** -0.5, out)))
        timed.append(("new", "default", bench_ms(paged_extend_triton.paged_extend_attention, q, k, v, table, plan,
                                                 PAGE, DIM ** -0.5, out)))
        if not fresh and len(lengths) == 1:
            try:
                timed.append(("cuDNN split", "gather+2 calls+merge",
                              cudnn_split_ms(q, k, v, table, lengths[0], kv_lens[0], out, name)))
            except Exception as exc:  # this torch's cuDNN attention refuses the shapes: not a candidate
                print(f"{name:<22} | cuDNN split failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        for stages in (2, 4) if stage_variants else ():  # the default's 3 is timed above
            cfg = (tokens, 128, 8, stages)
            try:
                ms = bench_ms(paged_extend_triton.paged_extend_attention, q, k, v, table, plan, PAGE, DIM ** -0.5,
                              out, cfg)
            except Exception as exc:
                logger.info("extend %s failed: %s", cfg, type(exc).__name__)
                continue
            timed.append(("new", " ".join(f"{x:>5}" for x in cfg), ms))
        for kernel, cfg, ms in timed:
            rows.append({"case": name, "kernel": kernel, "launch": cfg, "ms": ms, "tflops": tflop / ms * 1e3,
                         "over_sdpa": ms / sdpa})
            print(f"{name:<22} | {kernel:<12} {cfg:<29} | {ms:6.3f} | {tflop / ms * 1e3:7.0f} | {ms / sdpa:.2f}")
        del table, k, v
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--what", nargs="+", default=["extend", "decode"], choices=["extend", "decode"])
    parser.add_argument("--decode-cases", nargs="+", default=["256x512", "256x640", "256x1024", "64x1024"],
                        help="decode shapes, BATCHxCONTEXT")
    parser.add_argument("--baseline", type=Path, default=None, help="a splitserve checkout to compare against")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                        help="decode: the pages' dtype (fp8_e4m3: the FP8 cache, its bytes counted at one a value)")
    parser.add_argument("--extend-cases", nargs="+", default=None, help="names of EXTEND_CASES (default: all)")
    parser.add_argument("--extend-stage-variants", action="store_true",
                        help="also time the extend kernel at 2 and 4 stages")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    decode_base = extend_base = None
    if args.baseline is not None:
        layers = args.baseline / "engine" / "layers"
        decode_base = load_module(layers / "paged_decode_triton.py", "baseline_paged_decode")
        extend_base = load_module(layers / "paged_extend_triton.py", "baseline_paged_extend")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {torch.cuda.get_device_name()}")
    report: dict = {"copy_bandwidth_Bps": bandwidth, "baseline": str(args.baseline) if args.baseline else None}
    if "decode" in args.what:
        report["decode"] = sweep_decode([tuple(int(v) for v in c.split("x")) for c in args.decode_cases],
                                        decode_base, bandwidth, args.kv_cache_dtype == "fp8_e4m3")
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    if "extend" in args.what:
        if args.extend_cases:
            for name in list(EXTEND_CASES):
                if name not in args.extend_cases:
                    del EXTEND_CASES[name]
        report["extend"] = sweep_extend(extend_base, args.extend_stage_variants)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
