"""`splitserve bench --profile kv-tiers`: the host-memory KV tier (--host-kv-tokens) against the device
prefix cache alone, on the bare engine (no HTTP), in one run.

A seeded multi-turn trace: `--conversations` conversations, each a fresh `--system-len`-token opening,
then `--turns` turns; every turn's prompt is the conversation so far (the last prompt, its answer) plus
a new `--user-len`-token message. All conversations run at once, each sending its next turn as soon as
its answer is in (closed loop), so their prefixes compete for the device KV (`--max-total-tokens`),
which holds a fraction of the working set (printed: the conversations' final lengths summed, over the
device KV). The same trace runs on an engine without the tier and on one with `--host-kv-tokens`;
printed: mean and p50 TTFT, output and total throughput, prompt tokens computed and the tier's hits,
and the ratios (tier / none). Greedy, so both runs see the same tokens (checked).

With `--kv-store local` (a Mooncake Store master started here on loopback) or `--kv-store HOST:PORT`, a
store leg follows: a first instance (host tier and store) runs the trace, then a second one that never
saw it runs the same sessions beside it (a new replica taking the first's conversations over); printed:
the second instance's store hits over its prompt tokens (its hit rate on the first's sessions), its
TTFT and prompt tokens computed, and their ratios against the host-tier leg (a cold instance).

    splitserve bench --profile kv-tiers --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve bench --profile kv-tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=["kv-tiers"], default="kv-tiers", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help="model of the engine")
    p.add_argument("--shape", default="", help="a real model's shape with random weights instead of --model")
    p.add_argument("--reload-tokens", type=int, default=0, help="also time one prompt of this many tokens "
                   "computed, then again after its pages went to the host tier (0: skip)")
    p.add_argument("--device", default="cpu", help="device of the engine")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="device KV, in tokens")
    p.add_argument("--host-kv-tokens", type=int, default=32768, help="the host tier, in tokens")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=384, help="tokens of each conversation's opening")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each new message")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each answer")
    p.add_argument("--kv-store", default="", help="add the store leg: 'local' (start a mooncake_master on "
                   "loopback) or a master's HOST:PORT; empty: skip it")
    p.add_argument("--kv-store-segment-mb", type=int, default=256, help="each instance's share of the store")
    p.add_argument("--engine-args", default="", help="extra EngineConfig fields, as key=value,key=value")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="", help="write the figures as JSON here")
    return p.parse_args(argv)


def working_set_tokens(args: argparse.Namespace) -> int:
    per_conversation = args.system_len + args.turns * args.user_len + (args.turns - 1) * args.output_len
    return args.conversations * per_conversation


def engine_config(args: argparse.Namespace, host_kv_tokens: int, kv_store: str = "") -> EngineConfig:
    extra: dict[str, Any] = {}
    if kv_store:
        extra.update(kv_store=kv_store, kv_store_segment_mb=args.kv_store_segment_mb, kv_store_timeout_ms=1000.0)
    for item in filter(None, args.engine_args.split(",")):
        key, value = item.split("=", 1)
        extra[key.replace("-", "_")] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    if args.shape:
        extra.setdefault("load_format", "dummy")
    fields: dict[str, Any] = {
        "model": args.model, "device": args.device, "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens, "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size, "host_kv_tokens": host_kv_tokens,
        "context_length": max(4096, working_set_tokens(args) // max(1, args.conversations) + 64,
                              args.reload_tokens + 64)}
    return EngineConfig(**{**fields, **extra})


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    """The share of answers in `got` equal to `expected`'s, answer by answer."""
    return sum(a == b for a, b in zip(got, expected, strict=True)) / max(1, len(expected))


def run_trace(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The multi-turn trace, closed loop per conversation; TTFT per turn, wall time, outputs."""
    rng = random.Random(args.seed)
    vocab = 250

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    history = [fresh(args.system_len) for _ in range(args.conversations)]
    # Every message drawn up front: both runs get the same trace whatever the engine's timing.
    messages = [[fresh(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    lock = threading.Lock()
    done = threading.Event()
    ttfts: list[float] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    cached = [0]
    remaining = [args.conversations]
    errors: list[str] = []

    def submit(conv: int, turn: int) -> None:
        prompt = history[conv] + messages[conv][turn]
        sent = time.perf_counter()
        tokens: list[int] = []

        def on_output(out: TokenOutput) -> None:
            if out.token_ids and not tokens:
                with lock:
                    ttfts.append(time.perf_counter() - sent)
            tokens.extend(out.token_ids)
            if out.finish_reason is None:
                return
            with lock:
                if out.error:
                    errors.append(out.error)
                outputs[(conv, turn)] = list(tokens)
                cached[0] += out.cached_tokens
            history[conv] = prompt + tokens
            if turn + 1 < args.turns and not out.error:
                submit(conv, turn + 1)  # on the engine's thread: submit only queues it
            else:
                with lock:
                    remaining[0] -= 1
                    if not remaining[0]:
                        done.set()

        engine.submit(Request(f"kvt-{conv}-{turn}", prompt, params, on_output))

    start = time.perf_counter()
    for conv in range(args.conversations):
        submit(conv, 0)
    if not done.wait(3600):
        raise TimeoutError("the trace did not finish in an hour")
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:3]}")
    out_tokens = sum(len(t) for t in outputs.values())
    prompt_tokens = sum(args.system_len + (t + 1) * args.user_len + t * args.output_len
                        for t in range(args.turns)) * args.conversations
    reg = engine.metrics.registry

    def metric(name: str) -> float:
        return reg.get_sample_value(name, {"model": engine.cfg.model_name}) or 0.0

    return {
        "requests": len(outputs), "wall_s": wall, "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts), "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / wall, "prompt_tokens": prompt_tokens,
        "cached_tokens": cached[0], "prompt_tokens_computed": metric("splitserve_prompt_tokens_computed_total"),
        "host_hit_tokens": metric("splitserve_host_kv_hit_tokens_total"),
        "host_written_bytes": metric("splitserve_host_kv_written_bytes_total"),
        "host_loaded_bytes": metric("splitserve_host_kv_loaded_bytes_total"),
        "host_pages": metric("splitserve_host_kv_pages"),
        "host_load_mean_s": (metric("splitserve_host_kv_load_seconds_sum")
                             / max(1.0, metric("splitserve_host_kv_load_seconds_count"))),
        "store_hit_tokens": metric("splitserve_kv_store_hit_tokens_total"),
        "store_written_bytes": metric("splitserve_kv_store_written_bytes_total"),
        "store_read_bytes": metric("splitserve_kv_store_read_bytes_total"),
        "store_failures": metric("splitserve_kv_store_failures_total"),
        "store_load_mean_s": (metric("splitserve_kv_store_load_seconds_sum")
                              / max(1.0, metric("splitserve_kv_store_load_seconds_count"))),
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


def time_reload(engine: Engine, tokens: int, seed: int) -> dict[str, float]:
    """One prompt computed (TTFT cold), its device pages then evicted to the host tier, and the prompt
    plus one token again (TTFT with its prefix loaded from host memory)."""
    rng = random.Random(seed + 99)
    prompt = [rng.randrange(1, 250) for _ in range(tokens)]
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(ids: list[int], rid: str) -> tuple[float, int]:
        done, got = threading.Event(), {}
        sent = time.perf_counter()

        def on_output(out: TokenOutput) -> None:
            if out.finish_reason is not None:
                got.update(t=time.perf_counter() - sent, cached=out.cached_tokens, error=out.error)
                done.set()

        engine.submit(Request(rid, ids, params, on_output))
        if not done.wait(600) or got.get("error"):
            raise RuntimeError(f"reload probe {rid} failed: {got}")
        return got["t"], got["cached"]

    ttft([rng.randrange(1, 250) for _ in range(256)], "reload-warm")  # the first request's one-time costs
    computed_s, _ = ttft(prompt, "reload-cold")
    evicted = threading.Event()
    engine.call_soon(lambda: (engine.kv.prefix_cache.evict(engine.kv.prefix_cache.cached_pages), evicted.set()))
    evicted.wait(60)
    time.sleep(0.5)  # the write-back completes off the step
    loaded_s, cached = ttft([*prompt, 7], "reload-host")
    return {"tokens": tokens, "computed_ttft_s": computed_s, "host_loaded_ttft_s": loaded_s,
            "cached_tokens": cached, "speedup": computed_s / loaded_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.shape:
        import tempfile

        from splitserve.engine.checkpoints.model_shapes import write_shape_folder

        folder = write_shape_folder(args.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{args.shape}-")))
        args = argparse.Namespace(**{**vars(args), "model": str(folder)})
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "profile"},
                              "working_set_tokens": working_set_tokens(args),
                              "working_set_over_device_kv": working_set_tokens(args) / args.max_total_tokens}
    for name, host in (("device_only", 0), ("host_tier", args.host_kv_tokens)):
        engine = Engine(engine_config(args, host))
        report["dtype"] = str(engine.runner.dtype).removeprefix("torch.")
        engine.start()
        try:
            report[name] = run_trace(engine, args)
            if host and args.reload_tokens:
                report["reload"] = time_reload(engine, args.reload_tokens, args.seed)
        finally:
            engine.stop()
    if args.kv_store:
        report.update(run_store_leg(args))
    off, on = report["device_only"], report["host_tier"]
    expected = off.pop("outputs")
    # The share of answers equal to the device-only run's. In float32 every one must be (any cache split gives
    # the same logits to rounding); in 16-bit dtypes a prompt computed whole and one computed after a cached
    # prefix round differently (other attention kernels), so runs that cache different prefixes may part ways
    # on near-ties (random weights have many). tests/engine/test_host_kv_gpu.py holds a host hit to a device hit.
    report["output_agreement"] = {leg: agreement(report[leg].pop("outputs"), expected)
                                  for leg in ("host_tier", "store_first", "store_second") if leg in report}
    report["same_outputs"] = all(share == 1.0 for share in report["output_agreement"].values())
    if "store_second" in report:
        second = report["store_second"]
        report["store_hit_rate"] = second["store_hit_tokens"] / second["prompt_tokens"]
        # Of the prompt tokens the second instance did not find in its own device and host caches (what a
        # cold instance computes), the share the store gave it.
        report["store_share_of_misses"] = second["store_hit_tokens"] / max(
            1.0, second["store_hit_tokens"] + second["prompt_tokens_computed"])
        report["store_ratios"] = {
            "ttft_mean": second["ttft_mean_s"] / on["ttft_mean_s"],
            "ttft_p50": second["ttft_p50_s"] / on["ttft_p50_s"],
            "total_tokens_per_s": second["total_tokens_per_s"] / on["total_tokens_per_s"],
            "prompt_tokens_computed": second["prompt_tokens_computed"] / max(1.0, on["prompt_tokens_computed"]),
        }
    report["ratios"] = {
        "ttft_mean": on["ttft_mean_s"] / off["ttft_mean_s"],
        "ttft_p50": on["ttft_p50_s"] / off["ttft_p50_s"],
        "output_tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "total_tokens_per_s": on["total_tokens_per_s"] / off["total_tokens_per_s"],
        "prompt_tokens_computed": on["prompt_tokens_computed"] / max(1.0, off["prompt_tokens_computed"]),
    }
    return report


def run_store_leg(args: argparse.Namespace) -> dict[str, Any]:
    """The first instance runs the trace (writing through to the store as its pages leave the device), then a
    second one runs the same sessions while the first is still up (its store segment holds the pages)."""
    from splitserve.engine.store_kv import start_master

    master = None
    address = args.kv_store
    if address == "local":
        master, address = start_master()
    engines: list[Engine] = []
    legs: dict[str, Any] = {}
    try:
        for name in ("store_first", "store_second"):
            engine = Engine(engine_config(args, args.host_kv_tokens, address))
            engines.append(engine)
            store = engine.kv_store
            assert store is not None
            deadline = time.monotonic() + 120
            while not store.ready:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the store at {address} did not answer in 120 s")
                time.sleep(0.05)
            engine.start()
            legs[name] = run_trace(engine, args)
            while store.jobs_pending():  # the write-throughs are in before the next instance asks
                time.sleep(0.01)
    finally:
        for engine in engines:
            engine.stop()
        if master is not None:
            master.kill()
            master.wait()
    return legs


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"kv-tiers: {cfg['conversations']} conversations x {cfg['turns']} turns on {cfg['model']} ({cfg['device']}); "
          f"working set {report['working_set_tokens']} tokens = {report['working_set_over_device_kv']:.1f}x the "
          f"device KV ({cfg['max_total_tokens']}); host tier {cfg['host_kv_tokens']} tokens")
    print(f"{'':14}{'TTFT mean':>11}{'TTFT p50':>10}{'out tok/s':>11}{'tot tok/s':>11}{'computed':>10}"
          f"{'cached':>9}{'host hits':>10}{'wall s':>8}")
    for name in ("device_only", "host_tier", "store_first", "store_second"):
        if name not in report:
            continue
        r = report[name]
        print(f"{name:14}{r['ttft_mean_s'] * 1e3:9.1f}ms{r['ttft_p50_s'] * 1e3:8.1f}ms"
              f"{r['output_tokens_per_s']:11.1f}{r['total_tokens_per_s']:11.1f}{r['prompt_tokens_computed']:10.0f}"
              f"{r['cached_tokens']:9.0f}{r['host_hit_tokens']:10.0f}{r['wall_s']:8.2f}")
    on = report["host_tier"]
    print(f"host tier: {on['host_written_bytes'] / 2**20:.1f} MiB written back, {on['host_loaded_bytes'] / 2**20:.1f} "
          f"MiB loaded, mean load {on['host_load_mean_s'] * 1e3:.3f} ms, {on['host_pages']:.0f} pages held")
    r = report["ratios"]
    print(f"ratios (tier / none): TTFT mean {r['ttft_mean']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, output throughput "
          f"{r['output_tokens_per_s']:.2f}x, total throughput {r['total_tokens_per_s']:.2f}x, prompt tokens computed "
          f"{r['prompt_tokens_computed']:.2f}x")
    shares = ", ".join(f"{leg} {share:.3f}" for leg, share in report["output_agreement"].items())
    print(f"greedy answers equal to device_only's ({report['dtype']}; float32 must give 1.000): {shares}")
    if "store_second" in report:
        first, second, r = report["store_first"], report["store_second"], report["store_ratios"]
        print(f"store: the first instance wrote {first['store_written_bytes'] / 2**20:.1f} MiB; the second read "
              f"{second['store_read_bytes'] / 2**20:.1f} MiB, mean load {second['store_load_mean_s'] * 1e3:.2f} ms, "
              f"failures {first['store_failures'] + second['store_failures']:.0f}")
        print(f"store hit rate of the second instance on the first's sessions: {report['store_hit_rate']:.1%} of its "
              f"prompt tokens ({second['store_hit_tokens']:.0f} of {second['prompt_tokens']}); "
              f"{report['store_share_of_misses']:.1%} of what its own caches missed")
        print(f"ratios (second instance with the store / cold instance with the host tier): TTFT mean "
              f"{r['ttft_mean']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, total throughput {r['total_tokens_per_s']:.2f}x, "
              f"prompt tokens computed {r['prompt_tokens_computed']:.2f}x")


def print_reload(report: dict[str, Any]) -> None:
    r = report.get("reload")
    if r:
        print(f"reload of a {r['tokens']}-token prompt: computed {r['computed_ttft_s'] * 1e3:.1f} ms, from the host "
              f"tier {r['host_loaded_ttft_s'] * 1e3:.1f} ms ({r['cached_tokens']} tokens cached): "
              f"{r['speedup']:.2f}x faster")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    report = run(args)
    print_report(report)
    print_reload(report)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["same_outputs"] or report["dtype"] != "float32" else 1


if __name__ == "__main__":
    import sys
    raise SystemExit(main(sys.argv[1:]))
