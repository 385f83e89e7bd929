"""A kernel's Hopper machine code, counted, without a GPU: which loads and conversions the compiler emitted.

  python3 -P benchmarks/kernel_sass.py [--kernel decode skinny] [--kv-dtype fp8 model] [--q-dtype bf16 fp16]
                                       [--sass-dir DIR]

Compiles the engine's paged decode attention kernel (Llama-3.1-8B's shape: 32/8 heads x 128, 16-token pages,
its one-split launch), the skinny FP8 kernel (qkv's shape, its K-split launch), its e4m3-rows twin (down's
shape, K in parts: `QGMMA` is Hopper's e4m3 wgmma) and the e4m3 prompt attention (32/8 heads x 128) for sm_90
with Triton, the arguments marked 16-divisible as the runtime's specialization marks them, disassembles the
cubin with the nvdisasm Triton ships, and prints the instruction count, the shared memory, and the loads and
conversions by variant. It takes Triton and its bundled tools (pip install triton), not a device: what it shows
is what the code asks the hardware to do, not how fast that runs (benchmarks/attention_sweep.py and
fp8_gemv_sweep.py time it). An 8-bit tile gathered from shared memory a byte at a time shows as LDS.U8; e4m3
widened through float16 to bfloat16 as F2F (the slow conversion unit) next to F2FP.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

logger = logging.getLogger("kernel_sass")
HOPPER = GPUTarget("cuda", 90, 32)
WATCHED = re.compile(r"^(LDS|LDSM|LDG|LDGSTS|STS|F2F|F2FP|HMUL2|PRMT|HMMA|QGMMA|HGMMA|STL|LDL)\b")
TRITON_TYPES = {"bf16": "bf16", "fp16": "fp16"}


def paged_decode(kv_dtype: str, q_dtype: str) -> tuple:
    from splitserve.engine.layers import paged_decode_triton as decode

    block_n, warps, stages, heads_first = decode.ONE_SPLIT_LAUNCH
    constexprs = dict(PAGE_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_N=block_n, NUM_SPLITS=1,
                      FUSE_NEW=True, NEW_STORED=False, HEADS_FIRST=heads_first, DOT_PRECISION="tf32",
                      KV_FP8=kv_dtype == "fp8", PDL=True)
    q = f"*{TRITON_TYPES[q_dtype]}"
    kv = "*fp8e4nv" if kv_dtype == "fp8" else q
    pointers = {"Q": q, "K": kv, "V": kv, "Out": q, "KNew": q, "VNew": q, "PageTable": "*i32", "Slots": "*i32",
                "SeqLens": "*i32", "Loc": "*i64", "OutAcc": "*fp32", "OutLse": "*fp32", "Cos": "*fp32",
                "Sin": "*fp32", "KScale": "*fp32", "VScale": "*fp32"}
    return decode._paged_decode_split, constexprs, pointers, {"sm_scale": "fp32"}, dict(num_warps=warps,
                                                                                      num_stages=stages)


def skinny(kv_dtype: str, q_dtype: str) -> tuple:
    from splitserve.engine.quantization import fp8_cuda

    block_n, block_k, warps, stages, splits = fp8_cuda.skinny_launch(6144, 4096, torch.bfloat16)
    constexprs = dict(HAS_BIAS=False, SPLITS=splits, LAST_ADDS=True, BLOCK_N=block_n, BLOCK_K=block_k,
                      DOT_PRECISION="tf32", PDL=True)
    x = f"*{TRITON_TYPES[q_dtype]}"
    pointers = {"X": x, "W": "*fp8e4nv", "WScale": "*fp32", "Bias": "*fp32", "Y": x, "Partial": "*fp32",
                "Arrivals": "*i32"}
    return fp8_cuda._skinny_fp8, constexprs, pointers, {}, dict(num_warps=warps, num_stages=stages)


def skinny_rows(kv_dtype: str, q_dtype: str) -> tuple:
    from splitserve.engine.quantization import fp8_cuda

    block_n, block_k, warps, stages, splits = fp8_cuda.skinny_rows_launch(4096, 14336)  # down: K in parts
    constexprs = dict(HAS_BIAS=False, SPLITS=splits, LAST_ADDS=True, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True)
    pointers = {"XQ": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WScale": "*fp32", "Bias": "*fp32",
                "Y": f"*{TRITON_TYPES[q_dtype]}", "Partial": "*fp32", "Arrivals": "*i32"}
    return fp8_cuda._skinny_fp8_rows, constexprs, pointers, {}, dict(num_warps=warps, num_stages=stages)


def prompt_e4m3(kv_dtype: str, q_dtype: str) -> tuple:
    from splitserve.engine.layers import e4m3_prompt_attention_triton as prompt

    block_m, block_n, warps, stages = prompt.LAUNCH
    constexprs = dict(GROUP=4, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=block_n, P_SCALE=prompt.P_SCALE)
    q = f"*{TRITON_TYPES[q_dtype]}"
    pointers = {"Q": q, "K": "*fp8e4nv", "Vt": "*fp8e4nv", "KScale": "*fp32", "VScale": "*fp32", "Out": q}
    scalars = {"qk_scale": "fp32", "n": "i32", "kv_len": "i32", "prefix": "i32"}  # lengths: not specialized
    return prompt._e4m3_prompt_attention, constexprs, pointers, scalars, dict(num_warps=warps, num_stages=stages)


KERNELS = {"decode": paged_decode, "skinny": skinny, "skinny-rows": skinny_rows, "prompt-e4m3": prompt_e4m3}


def compile_counts(kernel: str, kv_dtype: str, q_dtype: str, sass_dir: Path | None) -> dict:
    fn, constexprs, pointers, scalars, options = KERNELS[kernel](kv_dtype, q_dtype)
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n) or scalars.get(n, "i32") for n in names}
    # As the launcher specializes them: pointers, strides and sizes that are multiples of 16 marked so.
    divisible = [i for i, n in enumerate(names) if n not in constexprs and n not in scalars]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=HOPPER, options=options)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    label = f"{kernel}-{q_dtype}-{kv_dtype}"
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{label}.sass").write_text(sass)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    watched = Counter(op for op in ops if WATCHED.match(op))
    return {"kernel": label, "instructions": len(ops), "shared_bytes": compiled.metadata.shared,
            "watched": dict(sorted(watched.items()))}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", nargs="+", default=sorted(KERNELS), choices=sorted(KERNELS))
    parser.add_argument("--kv-dtype", nargs="+", default=["fp8", "model"], choices=["fp8", "model"],
                        help="the decode kernel's KV pages: e4m3, or the model's dtype (the skinny kernel's "
                             "weight is always e4m3)")
    parser.add_argument("--q-dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16"],
                        help="the model's dtype: the query's, or the skinny kernel's rows")
    parser.add_argument("--sass-dir", type=Path, default=None, help="also write each disassembly here")
    args = parser.parse_args()
    for kernel in args.kernel:
        for q_dtype in args.q_dtype:
            for kv_dtype in args.kv_dtype if kernel == "decode" else ["fp8"]:
                counts = compile_counts(kernel, kv_dtype, q_dtype, args.sass_dir)
                logger.info("%-18s %5d instructions, %6d B shared | %s", counts["kernel"], counts["instructions"],
                            counts["shared_bytes"],
                            " ".join(f"{op} {n}" for op, n in counts["watched"].items()))


if __name__ == "__main__":
    main()
