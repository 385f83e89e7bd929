"""What a fresh prompt's attention costs the first time its length is seen, per SDPA backend.

The runner sends a lone fresh prompt through `scaled_dot_product_attention(is_causal=True,
enable_gqa=...)`. Some backends build a plan per shape (cuDNN compiles a graph), so a server whose
prompts have many lengths pays that build on the engine thread once per new length, with every
running request waiting behind it. This times, on Llama-3.1-8B's attention shape (32/8 heads x 128,
bf16), each backend's first call at lengths it has not seen against its warm call at the same
lengths, and says which backend the default dispatch picks.

With --engine, also the engine's own lone-prompt attention (engine/layers/prompt_attention.py): its cuDNN
buckets built first (as the runner's warm-up does), then its first call at new lengths against its warm
call, and its warm call against the default dispatch's (cuDNN unpadded) and flash's at the same lengths
(the padding's cost): each call alone with a synchronize around it, 32 in a row (a prompt's layers; the
host's or the device's time, whichever is longer) and the device's time alone (queued behind a sleep).
It runs against a tree from before the one-pad change too (its function takes no `qkv`), for a before/after.

  python3 -P benchmarks/sdpa_shape_cost.py [--lengths 97 301 ...] [--count 12] [--engine] [--json F]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM = 32, 8, 128
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}
logger = logging.getLogger("sdpa_shape_cost")


def prompt_qkv(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, H, L, D], k and v [1, Hkv, L, D], as the runner passes a lone prompt."""
    def draw(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, length, DIM, device="cuda", dtype=torch.bfloat16)
    return draw(HEADS), draw(KV_HEADS), draw(KV_HEADS)


def timed_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """One call's wall time, from a synchronized start to a synchronized end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def default_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The backend the default dispatch picks for these inputs."""
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    try:
        return SDPBackend(choice).name
    except ValueError:
        return str(choice)


def backend_cost(name: str, lengths: list[int]) -> dict:
    """First and warm call at each length (new to this backend), under one forced backend or the default."""
    first, warm = [], []
    for length in lengths:
        q, k, v = prompt_qkv(length)
        try:
            if name == "default":
                first.append(timed_ms(q, k, v))
                warm.append(min(timed_ms(q, k, v) for _ in range(3)))
            else:
                with sdpa_kernel([BACKENDS[name]]):
                    first.append(timed_ms(q, k, v))
                    warm.append(min(timed_ms(q, k, v) for _ in range(3)))
        except RuntimeError as err:  # a backend that refuses these inputs
            return {"backend": name, "refused": str(err).splitlines()[0][:200]}
    extra = [f - w for f, w in zip(first, warm, strict=True)]
    return {"backend": name, "lengths": lengths, "first_ms": first, "warm_ms": warm,
            "median_first_over_warm": statistics.median(f / w for f, w in zip(first, warm, strict=True)),
            "median_extra_ms": statistics.median(extra), "total_extra_ms": sum(extra)}


def synced_ms(call) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


LAYERS = 32  # calls in a row, as one prompt's layers make them


def in_a_row_ms(call) -> float:
    """Per call, LAYERS calls back to back with one synchronize at the end: the launches run ahead while
    the device works, so this is the slower of the host's and the device's time per call."""
    return synced_ms(lambda: [call() for _ in range(LAYERS)]) / LAYERS


def device_ms(call) -> float:
    """Per call, the device's time alone: LAYERS calls queued behind a ~30 ms sleep kernel (the host has
    launched them all before it ends), timed by events on the stream from the sleep's end to the last call."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(60_000_000)
    begin.record()
    for _ in range(LAYERS):
        call()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / LAYERS


def engine_cost(lengths: list[int], limit: int) -> dict:
    """The engine's lone-prompt attention: its buckets' builds, then first and warm calls at new lengths
    (inputs laid out as the runner's: [n, heads, D] views of the qkv projection, which the layer passes too
    where the engine's function takes it), and at the same lengths the default dispatch's and flash's warm
    calls: each alone (a synchronize around it), 32 in a row, and the device's time alone."""
    import inspect

    from splitserve.engine.layers.prompt_attention import (
        bucket_lengths,
        cudnn_at_bucket,
        flash_attention,
        lone_prompt_attention,
    )

    scale = DIM ** -0.5
    takes_qkv = "qkv" in inspect.signature(lone_prompt_attention).parameters  # a tree before the one pad: no

    def engine_qkv(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        qkv = torch.randn(length, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16)
        q = qkv[:, :HEADS * DIM].view(length, HEADS, DIM)
        k = qkv[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(length, KV_HEADS, DIM)
        v = qkv[:, (HEADS + KV_HEADS) * DIM:].view(length, KV_HEADS, DIM)
        return q, k, v, {"qkv": qkv} if takes_qkv else {}

    builds = []
    for bucket in bucket_lengths(limit):
        q, k, v, packed = engine_qkv(bucket)
        builds.append(synced_ms(lambda q=q, k=k, v=v, b=bucket, p=packed: cudnn_at_bucket(q, k, v, scale, b, **p)))
    first, warm = [], []
    timings: dict[str, list[float]] = {f"{who}_{how}": [] for who in ("engine", "default", "flash")
                                       for how in ("warm_ms", "row_ms", "device_ms")}
    for length in lengths:
        q, k, v, packed = engine_qkv(length)
        heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        calls = {"engine": lambda q=q, k=k, v=v, p=packed: lone_prompt_attention(q, k, v, scale, limit, **p),
                 "default": lambda h=heads_first: torch.nn.functional.scaled_dot_product_attention(
                     *h, is_causal=True, enable_gqa=True),
                 "flash": lambda q=q, k=k, v=v: flash_attention(q, k, v, scale)}
        first.append(synced_ms(calls["engine"]))
        for who, call in calls.items():
            call()  # the default's first call (a graph of its own), flash's first load
            timings[f"{who}_warm_ms"].append(min(synced_ms(call) for _ in range(3)))
            timings[f"{who}_row_ms"].append(min(in_a_row_ms(call) for _ in range(2)))
            timings[f"{who}_device_ms"].append(min(device_ms(call) for _ in range(2)))
        warm.append(timings["engine_warm_ms"][-1])
    extra = [f - w for f, w in zip(first, warm, strict=True)]

    def median_ratio(num: str, den: str, keep) -> float | None:
        picked = [a / b for n, a, b in zip(lengths, timings[num], timings[den], strict=True) if keep(n)]
        return statistics.median(picked) if picked else None

    ratios = {f"{'bucketed' if inside else 'flash'}_{how}_over_default_{how}":
              median_ratio(f"engine_{how}_ms", f"default_{how}_ms",
                           (lambda n: n <= limit) if inside else (lambda n: n > limit))
              for inside in (True, False) for how in ("warm", "row", "device")}
    return {"backend": "engine", "limit": limit, "takes_qkv": takes_qkv, "buckets": bucket_lengths(limit),
            "build_ms": builds, "lengths": lengths, "first_ms": first, "warm_ms": warm,
            "default_warm_ms": timings["default_warm_ms"], **timings,
            "median_first_over_warm": statistics.median(f / w for f, w in zip(first, warm, strict=True)),
            "median_extra_ms": statistics.median(extra), "total_extra_ms": sum(extra), **ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", help="prompt lengths (default: seeded, 64-4096)")
    parser.add_argument("--count", type=int, default=12, help="seeded lengths per backend")
    parser.add_argument("--engine", action="store_true",
                        help="also the engine's lone-prompt attention (cuDNN buckets, flash past them)")
    parser.add_argument("--engine-limit", type=int, default=2048, help="its largest bucket (the chunk budget)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = random.Random(0)
    names = ["default", *BACKENDS]
    # Each backend gets lengths no earlier backend saw, so no plan cache carries over between them.
    if args.lengths:
        sets = [[length + offset for length in args.lengths] for offset in range(len(names))]
    else:  # one draw of distinct lengths, split between the backends
        drawn = rng.sample(range(64, 4097), args.count * len(names))
        sets = [sorted(drawn[i * args.count:(i + 1) * args.count]) for i in range(len(names))]
    warm_q, warm_k, warm_v = prompt_qkv(16)
    logger.info("default dispatch picks %s (torch %s, cuDNN %s)", default_choice(warm_q, warm_k, warm_v),
                torch.__version__, torch.backends.cudnn.version())
    timed_ms(warm_q, warm_k, warm_v)  # the CUDA context and the default backend's first load, outside the figures
    results = []
    for name, lengths in zip(names, sets, strict=True):
        result = backend_cost(name, lengths)
        results.append(result)
        if "refused" in result:
            logger.info("%-9s refused: %s", name, result["refused"])
            continue
        logger.info("%-9s first call at a new length %.1fx its warm call (median); %.1f ms more a new length "
                    "(median), %.0f ms over %d lengths", name, result["median_first_over_warm"],
                    result["median_extra_ms"], result["total_extra_ms"], len(lengths))
    if args.engine:
        # New lengths again (offset past every set above), the bucket lengths excluded; past the limit: flash.
        lengths = sorted({n + len(names) for n in sets[0]} - set(range(0, args.engine_limit + 1, 256)))
        result = engine_cost(lengths, args.engine_limit)
        results.append(result)
        logger.info("engine    %d buckets built in %.0f ms (%.1f ms a graph, median); first call at a new length "
                    "%.1fx its warm call (median); %.1f ms more a new length (median), %.0f ms over %d lengths",
                    len(result["buckets"]), sum(result["build_ms"]), statistics.median(result["build_ms"] or [0.0]),
                    result["median_first_over_warm"], result["median_extra_ms"], result["total_extra_ms"],
                    len(lengths))
        logger.info("engine    warm call over the default dispatch's warm call at the same length (median): "
                    "%s in a bucket (cuDNN, padded), %s past the buckets (flash)",
                    *(f"{r:.2f}x" if r is not None else "none" for r in (result["bucketed_warm_over_default_warm"],
                                                                          result["flash_warm_over_default_warm"])))
        for how, what in (("row", f"{LAYERS} calls in a row"), ("device", "the device's time alone")):
            logger.info("engine    %s over the default dispatch's (median): %s in a bucket, %s past them", what,
                        *(f"{r:.2f}x" if r is not None else "none"
                          for r in (result[f"bucketed_{how}_over_default_{how}"],
                                    result[f"flash_{how}_over_default_{how}"])))
        logger.info("%7s %8s | %-26s | %-26s | %-26s", "length", "bucket", "engine warm/row/device ms",
                    "default warm/row/device ms", "flash warm/row/device ms")
        from splitserve.engine.layers.prompt_attention import prompt_bucket

        for i, length in enumerate(lengths):
            bucket = prompt_bucket(length, args.engine_limit)  # the engine's own rule, not its step written again
            logger.info("%7d %8s | %s | %s | %s", length, bucket if bucket is not None else "flash",
                        *(" ".join(f"{result[f'{who}_{how}_ms'][i]:8.3f}" for how in ("warm", "row", "device"))
                          for who in ("engine", "default", "flash")))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                       "default": default_choice(warm_q, warm_k, warm_v), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
