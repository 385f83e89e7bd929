"""`splitserve bench --profile fp8`: FP8 weights against bfloat16 on a real model shape with random weights
(`--load-format dummy`; `--quantization fp8` quantizes them per channel on load), same device, same run.

Three sides: bf16; FP8 weights (`--quantization fp8`, e4m3 decode rows by default); FP8 weights with the FP8 KV
cache (`--kv-cache-dtype fp8_e4m3`), as they are deployed together on Hopper; and a fourth for the decode step
alone, FP8 weights with 16-bit decode rows (`--fp8-decode-rows w8a16`), the default's peer.
Times, each side in turn (the runner driven directly, as bench/engine_steps.py does):
- a decode step at batch 1 (`--context` tokens of KV; through the decode CUDA graph, one host sync a step; the
  median of five runs of 20 steps);
- a prefill of one `--prefill-len`-token prompt, eagerly, in tokens/s;
- the burst `--burst` (N prompts of I tokens, O output tokens each, all at once) through the bare engine
  (bench/api_split.py's), output tokens/s;
and prints each FP8 side over bf16 (decode: its step's time over bf16's; prefill and burst: tok/s over bf16's;
the weights' bytes and the KV cache's bytes a token, whose inverse is how many more tokens the same memory holds).

Then the accuracy of FP8 weights and of an FP8 KV cache (its prompts attending in e4m3, and widened) against
bfloat16 on the same random weights (the dummy weights of a model and its FP8 twin are the same draws): mean KL
per token, teacher-forced top-1 and greedy agreement on fixed prompts (bench/accuracy.py). Random weights make
the logits near-flat, so these state the quantization noise of the shape's products, not a trained model's
accuracy.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.engine_steps import EngineUnderTest
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_shapes import write_shape_folder
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# side -> (--quantization, --kv-cache-dtype, --fp8-decode-rows): FP8 weights alone, with the FP8 KV cache deployed
# beside them (both with the default e4m3 decode rows), and with 16-bit decode rows (the decode step only)
MODES = {"bf16": ("auto", "auto", "w8a8"), "fp8": ("fp8", "auto", "w8a8"),
         "fp8+kv": ("fp8", "fp8_e4m3", "w8a8"), "fp8/w8a16": ("fp8", "auto", "w8a16")}
DECODE_ONLY = ("fp8/w8a16",)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="model shape (random weights)")
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens of the batch-1 decode step")
    parser.add_argument("--prefill-len", type=int, default=8192, help="tokens of the timed prompt")
    parser.add_argument("--burst", default="256x512:256", help="NxI:O through the bare engine ('' skips it)")
    parser.add_argument("--reps", type=int, default=5, help="timed prefills (the median counts)")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="also state FP8 weights' and FP8 KV's accuracy against bfloat16")
    parser.add_argument("--output", "--out", dest="out", default=None, help="write the report here as JSON")
    return parser.parse_args(argv)


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, side: str) -> dict[str, Any]:
    quantization, kv_dtype, decode_rows = MODES[side]
    eut = EngineUnderTest(args.shape, args.device, 1, args.prefill_len + args.context + 256,
                          quantization=quantization, kv_cache_dtype=kv_dtype, fp8_decode_rows=decode_rows)
    try:
        row: dict[str, Any] = {"weight_bytes": eut.weight_bytes, "kv_bytes_per_token": eut.kv_bytes_per_token}
        row["decode_b1_s"] = eut.decode_step_seconds(1, args.context)
        if side not in DECODE_ONLY:
            row["prefill_tok_s"] = args.prefill_len / eut.prefill_seconds(args.prefill_len, reps=args.reps)
        folder = eut.folder
    finally:
        del eut
        free_device()
    logger.info("%s: decode b1 %.3f ms, prefill %d: %s tok/s", side, row["decode_b1_s"] * 1e3, args.prefill_len,
                f"{row['prefill_tok_s']:.0f}" if "prefill_tok_s" in row else "-")
    if args.burst and side not in DECODE_ONLY:
        from splitserve.bench.api_split import bare_engine_load
        from splitserve.bench.serving import fixed_load

        load = fixed_load(args.burst, "--burst")
        extra = f"--quantization {quantization} --kv-cache-dtype {kv_dtype}"
        burst = bare_engine_load(folder, args.device, len(load.prompt_lens), extra, load, seed=0)
        row["burst_tok_s"] = burst["output_tokens_per_s"]
        row["burst_ttft_p50_s"] = burst["ttft_p50_s"]
        free_device()
    return row


def twin(shape: str, device: str, **fields: Any) -> tuple[ModelRunner, KVCache]:
    """An eager runner of `shape` with the dummy weights and `fields` (quantization, KV dtype), and its KV cache."""
    folder = write_shape_folder(shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{shape}-")))
    cfg = EngineConfig(model=str(folder), device=device, load_format="dummy", max_running_requests=4,
                       max_total_tokens=4096, context_length=4096, page_size=16, **fields)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    return runner, KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 4096, runner.device)


def accuracy_on_shape(shape: str, device: str) -> dict[str, dict[str, float]]:
    """FP8 weights' and FP8 KV's accuracy against the bfloat16 model on the same random weights; FP8 KV twice: its
    prompts attending in e4m3 where the GPU can (the default), and over the pages widened for cuDNN."""
    from splitserve.bench.accuracy import accuracy

    reference = twin(shape, device)
    vocab = reference[0].model_cfg.vocab_size
    out = {}
    for name, fields in (("fp8_weights", {"quantization": "fp8"}), ("fp8_kv", {"kv_cache_dtype": "fp8_e4m3"}),
                         ("fp8_kv_widened_prompts", {"kv_cache_dtype": "fp8_e4m3", "fp8_prompt_attention": "off"})):
        candidate = twin(shape, device, **fields)
        out[name] = accuracy(reference, candidate, vocab)
        del candidate
        free_device()
    return out


def ratios(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each FP8 side over bf16 (> 1: FP8 faster; the byte ratios < 1: FP8 smaller)."""
    bf16 = report["bf16"]
    out = {}
    for side in MODES:
        if side == "bf16" or side not in report:
            continue
        fp8 = report[side]
        row = {"decode_b1_time": fp8["decode_b1_s"] / bf16["decode_b1_s"],
               "weight_bytes": fp8["weight_bytes"] / bf16["weight_bytes"],
               "kv_bytes_per_token": fp8["kv_bytes_per_token"] / bf16["kv_bytes_per_token"]}
        if "prefill_tok_s" in fp8:
            row["prefill_speedup"] = fp8["prefill_tok_s"] / bf16["prefill_tok_s"]
        if "burst_tok_s" in bf16 and "burst_tok_s" in fp8:
            row["burst_speedup"] = fp8["burst_tok_s"] / bf16["burst_tok_s"]
        out[side] = row
    return out


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"FP8 vs bf16, {args.shape} (random weights) on {report['device']}")
    print(f"{'':9} | {'weights GiB':>11} | {'KV B/token':>10} | {'decode b1 ms':>12} | "
          f"{f'prefill {args.prefill_len} tok/s':>18} | {f'burst {args.burst} tok/s':>24}")
    for side in MODES:
        r = report[side]
        burst = f"{r['burst_tok_s']:24.0f}" if "burst_tok_s" in r else f"{'-':>24}"
        prefill = f"{r['prefill_tok_s']:18.0f}" if "prefill_tok_s" in r else f"{'-':>18}"
        print(f"{side:9} | {r['weight_bytes'] / 2**30:11.2f} | {r['kv_bytes_per_token']:10d} | "
              f"{r['decode_b1_s'] * 1e3:12.3f} | {prefill} | {burst}")
    for side, row in report["ratios"].items():
        print(f"{side} over bf16 (decode: time, < 1 faster; prefill, burst: tok/s, > 1 faster): "
              + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    for name, acc in report.get("accuracy", {}).items():
        print(f"{name} against bf16 (same random weights): mean KL {acc['mean_kl']:.4g} per token, top-1 "
              f"{acc['top1']:.3f}, greedy {acc['greedy']:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = EngineConfig(device=args.device).torch_device()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "args": vars(args)}
    for side in MODES:
        report[side] = measure(args, side)
    report["ratios"] = ratios(report)
    if args.accuracy:
        report["accuracy"] = accuracy_on_shape(args.shape, args.device)
    print_report(report, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
