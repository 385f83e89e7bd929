"""`splitserve bench`: load a server over HTTP, or time the bare engine, and print ratios.

  splitserve bench                        # starts a tiny-model server, loads it, and times the
                                          # bare engine on the same work as the peer
  splitserve bench --url http://host:port # loads a running server (router or engine)
  splitserve bench --profile chaos --chaos-duration-s 150
                                          # 2P2D under load while random processes are killed
                                          # (and restarted): ok / clear errors / hung, p99, recovery
  splitserve bench --profile checkpoint --model smollm2 --gen-batches 1 8
                                          # a real checkpoint in the engine and in transformers
                                          # generate on the same chat prompts: tok/s and the ratio
  splitserve bench --profile engine --shape llama-3.1-8b
                                          # a real model shape with random weights: prefill MFU and
                                          # decode step vs roofline, and transformers as the peer
  splitserve bench --profile serving --shape llama-3.1-8b --rates 4 16 inf
                                          # a server of that shape under open-loop load (fixed lengths,
                                          # a ShareGPT-like mix at several rates) vs its bound
  splitserve bench --profile structured --model smollm2 --concurrency 8
                                          # decode tokens/s under a JSON schema / unconstrained

Figures are printed as ratios: HTTP throughput against the bare engine measured in the same
run; prefill against the measured matmul peak; decode step time against the memory-bandwidth
roofline measured on this machine; both against transformers on the same shape.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from splitserve.bench.chaos import print_chaos_report
from splitserve.bench.load_client import client_line, default_client_processes
from splitserve.bench.report_file import write_report
from splitserve.bench.stats import percentiles, scrape_metric_totals
from splitserve.bench.workload import random_prompts, run_engine_batch
from splitserve.config_flags import add_config_flags, config_from_args

logger = logging.getLogger(__name__)


PROFILES = {
    "http": "load a server over HTTP (--url, or one this command starts) against the bare engine on the same work",
    "engine": "the engine on a real model shape (--shape, random weights): prefill against the measured matmul "
              "peak, decode steps against the memory-bandwidth roofline, transformers as the peer",
    "pd": "TTFT of one prefill and one decode engine against one unified engine",
    "serving": "a server of --shape under open-loop load at --rates, against the bound from this run's limits",
    "chaos": "two prefill and two decode engines under load while random processes are killed and restarted",
    "checkpoint": "--model (e.g. smollm2) generating in the engine and in transformers on the same chat prompts",
    "structured": "decode tokens/s under a JSON schema against unconstrained decoding, on the same prompts",
    "api-split": "--fixed-loads on a server of --shape, in one process and with --engine-process, against the "
                 "bare engine",
    "spec": "decode tokens/s with a drafter against plain decoding, same engine, same run (own flags: "
            "bench --profile spec --help)",
    "epd": "encoder disaggregation against the unified engine (own flags: bench --profile epd --help)",
    "transfer": "the KV transfer layer against raw Mooncake, memcpy and a socket (own flags: "
                "bench --profile transfer --help)",
    "prefix": "cache-aware routing against least-loaded routing on shared-prefix, fresh and multi-turn loads, and one "
              "cache holding everything as the hit rate's ceiling (own flags: bench --profile prefix --help)",
    "kv-tiers": "the host-memory KV tier against the device prefix cache alone on a multi-turn trace (own flags)",
    "fp8": "FP8 weights against bfloat16: a decode step at batch 1, prefill, a burst (own flags)",
    "phases": "where the time to first token goes, phase by phase, for 1P1D against unified under the same load "
              "(own flags: bench --profile phases --help)",
    "qwen-vl": "Qwen2.5-VL (7B-shaped): the vision tower against its FLOP bound, embedding transfer against a device "
               "copy, image-heavy chat on the unified engine against encode + prefill + decode (own flags)",
}
# Profiles that parse flags of their own: `bench --profile NAME ...` hands them the rest.
OWN_FLAGS = {"spec": "splitserve.bench.spec", "epd": "splitserve.bench.epd", "transfer": "splitserve.bench.transfer",
             "prefix": "splitserve.bench.prefix_routing", "kv-tiers": "splitserve.bench.kv_tiers",
             "fp8": "splitserve.bench.fp8", "phases": "splitserve.bench.phases", "qwen-vl": "splitserve.bench.qwen_vl"}


@dataclass
class BenchConfig:
    """What load to generate and against what."""

    url: str | None = field(default=None, metadata={"help": "server to load (default: start one)"})
    profile: str = field(default="http", metadata={
        "help": "which benchmark (listed below)", "choices": tuple(PROFILES)})
    model: str = field(default="tiny", metadata={"help": "model for the server/engine this command starts"})
    device: str = field(default="auto", metadata={"help": "device for the engine this command starts"})
    num_requests: int = field(default=64, metadata={"help": "requests to send"})
    concurrency: int = field(default=16, metadata={"help": "requests in flight at once"})
    input_len: int = field(default=128, metadata={"help": "prompt tokens per request"})
    output_len: int = field(default=64, metadata={"help": "output tokens per request"})
    shape: str = field(default="llama-3.1-8b", metadata={"help": "engine profile: model shape (random weights)"})
    prefill_lens: list[int] = field(default_factory=lambda: [512, 2048, 8192],
                                    metadata={"help": "engine profile: prompt lengths for prefill"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 64, 256],
                                   metadata={"help": "engine profile: decode batch sizes"})
    decode_context: int = field(default=1024, metadata={"help": "engine profile: tokens per sequence when decoding"})
    hf_peer: bool = field(default=True, metadata={"help": "engine profile: measure transformers on the same shape"})
    gen_batches: list[int] = field(default_factory=lambda: [1, 8, 64],
                                   metadata={"help": "engine, checkpoint profiles: generate batch sizes"})
    repeats: int = field(default=3, metadata={
        "help": "checkpoint profile: timed runs of each side, interleaved (the median counts)"})
    plot: str | None = field(default=None, metadata={"help": "engine and serving profiles: write a PNG plot here"})
    concurrency_levels: list[int] = field(default_factory=lambda: [1, 4],
                                          metadata={"help": "pd profile: concurrency levels to load at"})
    unified_replicas: int = field(default=1, metadata={"help": "pd profile: unified replicas (data parallel)"})
    engine_args: str = field(default="", metadata={"help": "pd and serving profiles: extra flags for every engine"})
    rates: list[float] = field(default_factory=lambda: [4.0, 16.0, float("inf")], metadata={
        "help": "serving profile: request rates (req/s) of the ShareGPT-like load; inf: all at once"})
    fixed_loads: list[str] = field(default_factory=lambda: ["256x512:256"], metadata={
        "help": "serving profile: fixed-length loads NxI:O (N prompts of I tokens, O output tokens, all at once)"})
    max_prompt_len: int = field(default=4096, metadata={"help": "serving profile: longest ShareGPT-like prompt"})
    max_output_len: int = field(default=1024, metadata={"help": "serving profile: longest ShareGPT-like output"})
    max_running_requests: int = field(default=0, metadata={
        "help": "engine batch limit (0: the engine's default for its device)"})
    seed: int = field(default=0, metadata={"help": "seed of the random prompts"})
    chaos_duration_s: float = field(default=150.0, metadata={"help": "chaos profile: seconds of load (bounded)"})
    chaos_kill_every_s: float = field(default=20.0, metadata={
        "help": "chaos profile: mean seconds between SIGKILLs of a random process"})
    chaos_roles: list[str] = field(default_factory=lambda: ["prefill", "decode", "router"], metadata={
        "help": "chaos profile: roles whose processes may be killed"})
    client_processes: int = field(default_factory=default_client_processes, metadata={
        "help": "http, pd, serving and api-split profiles: client worker processes the load is spread over "
                "(one process reading every stream can be the bound; default min(8, CPUs))"})
    output: str | None = field(default=None, metadata={"help": "write the figures as JSON here"})


# ---- HTTP load ------------------------------------------------------------------------------

def http_load(url: str, cfg: BenchConfig) -> dict:
    """`cfg.num_requests` prompts, at most `cfg.concurrency` in flight (closed loop), from
    `cfg.client_processes` client workers."""
    from splitserve.bench.load_client import StreamRequest, client_summary, run_requests

    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    requests = [StreamRequest(p, cfg.output_len) for p in random_prompts(cfg.num_requests, cfg.input_len, cfg.seed)]
    run = run_requests(url, model, requests, cfg.client_processes, concurrency=cfg.concurrency, timeout_s=600)
    timings, wall = run.timings, run.wall_s
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "requests": len(timings), "ok": len(ok), "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if not t.ok})[:3],
        "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + len(ok) * cfg.input_len) / wall,
        "request_per_s": len(ok) / wall,
        "ttft_s": percentiles([t.ttft for t in ok]),
        "itl_s": percentiles([x for t in ok for x in t.itls]),
        "latency_s": percentiles([t.latency for t in ok]),
        "client": client_summary(run),
    }


# ---- the bare engine ------------------------------------------------------------------------

def bare_engine_peer(cfg: BenchConfig) -> dict:
    """The bare engine (no HTTP) on the same prompts and concurrency as the HTTP load."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine

    engine = Engine(EngineConfig(model=cfg.model, device=cfg.device, max_running_requests=cfg.max_running_requests,
                                 disable_prefix_cache=True))
    engine.start()
    try:
        run_engine_batch(engine, random_prompts(2, 16, 99), 4)  # warm-up
        return run_engine_batch(engine, random_prompts(cfg.concurrency, cfg.input_len, cfg.seed), cfg.output_len)
    finally:
        engine.stop()


def start_local_server(cfg: BenchConfig) -> tuple[subprocess.Popen, str]:
    from splitserve.launcher.up import free_port, wait_healthy

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve", "serve", "--model", cfg.model,
                             "--device", cfg.device, "--port", str(port), "--max-running-requests",
                             str(cfg.max_running_requests), "--disable-prefix-cache"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([(url, proc)], timeout=180)
    return proc, url


def print_report(report: dict) -> None:
    lines = []
    if "http" in report:
        h = report["http"]
        lines.append(f"HTTP: {h['ok']}/{h['requests']} ok, {h['output_tokens_per_s']:.1f} output tok/s, "
                     f"{h['request_per_s']:.2f} req/s")
        for key in ("ttft_s", "itl_s", "latency_s"):
            p = h[key]
            lines.append(f"  {key[:-2]:>8}: p50 {p['p50'] * 1e3:8.1f} ms  p90 {p['p90'] * 1e3:8.1f} ms  "
                         f"p99 {p['p99'] * 1e3:8.1f} ms")
        lines.append(client_line(h["client"]))
    if "bare_engine" in report:
        e = report["bare_engine"]
        lines.append(f"bare engine, same prompts at concurrency {e['batch']}: {e['output_tokens_per_s']:.1f} output "
                     f"tok/s, decode step {e['decode_step_s'] * 1e3:.2f} ms")
        lines.append(f"HTTP throughput / bare engine on the same work: {report['http_over_engine']:.2f}")
    for line in lines:
        print(line)  # the report is the command's output


def pd_ttft(cfg: BenchConfig) -> dict:
    """A 1P1D deployment and data-parallel unified replicas on the same devices (one engine per
    GPU where there are GPUs), the same prompts at each concurrency level, in one run."""
    import dataclasses

    from splitserve.launcher.up import Deployment, UpConfig, free_port

    results: dict = {"levels": cfg.concurrency_levels, "unified": {}, "1p1d": {}}
    shapes = (("unified", {"unified": cfg.unified_replicas}), ("1p1d", {"prefill": 1, "decode": 1}))
    for name, shape in shapes:
        deployment = Deployment(UpConfig(model=cfg.model, device=cfg.device, port=free_port(),
                                         engine_args=f"--disable-prefix-cache {cfg.engine_args}".strip(), **shape))
        try:
            url = deployment.start()
            for level in cfg.concurrency_levels:
                run_cfg = dataclasses.replace(cfg, concurrency=level, num_requests=max(cfg.num_requests, level))
                results[name][level] = http_load(url, run_cfg)
                if name == "1p1d":
                    totals = scrape_metric_totals(deployment, "splitserve_transfer_")
                    results.setdefault("transfer_metrics", {})[level] = totals
        finally:
            deployment.stop()
    results["ratios"] = {}
    for level in cfg.concurrency_levels:
        pd, uni = results["1p1d"][level], results["unified"][level]
        results["ratios"][level] = {
            "ttft_p50_1p1d_over_unified": pd["ttft_s"]["p50"] / uni["ttft_s"]["p50"],
            "itl_p50_1p1d_over_unified": pd["itl_s"]["p50"] / uni["itl_s"]["p50"],
            "throughput_1p1d_over_unified": pd["output_tokens_per_s"] / uni["output_tokens_per_s"],
        }
    return results


def print_pd_report(r: dict) -> None:
    for level in r["levels"]:
        for name in ("unified", "1p1d"):
            h = r[name][level]
            print(f"concurrency {level:>3} {name:>8}: TTFT p50 {h['ttft_s']['p50'] * 1e3:8.1f} ms "
                  f"p90 {h['ttft_s']['p90'] * 1e3:8.1f} ms | ITL p50 {h['itl_s']['p50'] * 1e3:6.2f} ms "
                  f"p90 {h['itl_s']['p90'] * 1e3:6.2f} ms | {h['output_tokens_per_s']:.1f} output tok/s "
                  f"({h['ok']}/{h['requests']} ok)")
            print(f"concurrency {level:>3} {name:>8}: {client_line(h['client'])}")
        ratio = r["ratios"][level]
        print(f"concurrency {level:>3} 1P1D / unified: TTFT p50 {ratio['ttft_p50_1p1d_over_unified']:.2f}, "
              f"ITL p50 {ratio['itl_p50_1p1d_over_unified']:.2f}, "
              f"throughput {ratio['throughput_1p1d_over_unified']:.2f}")


def chaos_run(cfg: BenchConfig) -> dict:
    """2 prefill + 2 decode under `splitserve up` supervision, loaded while processes are killed."""
    import signal

    from splitserve.bench.chaos import ChaosConfig, run_chaos
    from splitserve.launcher.up import Deployment, UpConfig, free_port

    if not 0 < cfg.chaos_duration_s <= 3600:
        raise ValueError("--chaos-duration-s must be in (0, 3600]")
    # SIGTERM (a `timeout`, a CI runner) stops the deployment too: its processes have sessions of their own.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deployment = Deployment(UpConfig(model=cfg.model, device=cfg.device, port=free_port(), prefill=2, decode=2,
                                     engine_args=cfg.engine_args, restart_backoff_s=1.0))
    try:
        deployment.start()
        return run_chaos(deployment, ChaosConfig(
            duration_s=cfg.chaos_duration_s, kill_every_s=cfg.chaos_kill_every_s, roles=cfg.chaos_roles,
            concurrency=cfg.concurrency, prompt_len=cfg.input_len, max_tokens=cfg.output_len, seed=cfg.seed))
    finally:
        deployment.stop()


def stop_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a job runner) unwinds the bench like Ctrl-C: the deployments it started run in
    sessions of their own, so only its `finally` blocks stop them; killed outright it would leave them
    holding their ports and GPU memory."""
    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)


def main(argv: list[str]) -> int:
    stop_on_sigterm()
    epilog = "profiles:\n" + "\n".join(textwrap.fill(f"{name}: {text}", 100, initial_indent="  ",
                                                      subsequent_indent="      ") for name, text in PROFILES.items())
    parser = argparse.ArgumentParser(prog="splitserve bench", description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    profile_only = argparse.ArgumentParser(add_help=False)
    profile_only.add_argument("--profile")
    chosen, rest = profile_only.parse_known_args(argv)
    if chosen.profile in OWN_FLAGS:
        module = importlib.import_module(OWN_FLAGS[chosen.profile])
        return module.main(rest)
    add_config_flags(parser, BenchConfig, "SPLITSERVE_BENCH")
    cfg = config_from_args(BenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH")
    report: dict = {"config": asdict(cfg)}
    if cfg.profile == "pd":
        report["pd"] = pd_ttft(cfg)
        print_pd_report(report["pd"])
    elif cfg.profile == "serving":
        from splitserve.bench.serving import plot_serving_report, print_serving_report, run_serving_benchmark
        report["serving"] = run_serving_benchmark(cfg)
        print_serving_report(report["serving"])
        if cfg.plot:
            plot_serving_report(report["serving"], Path(cfg.plot))
    elif cfg.profile == "api-split":
        from splitserve.bench.api_split import print_api_split_report, run_api_split_benchmark
        report["api_split"] = run_api_split_benchmark(cfg)
        print_api_split_report(report["api_split"])
    elif cfg.profile == "structured":
        from splitserve.bench.structured import print_structured_report, run_structured_benchmark
        report["structured"] = run_structured_benchmark(cfg)
        print_structured_report(report["structured"])
    elif cfg.profile == "chaos":
        report["chaos"] = chaos_run(cfg)
        print_chaos_report(report["chaos"])
    elif cfg.profile == "checkpoint":
        from splitserve.bench.checkpoint import print_checkpoint_report, run_checkpoint_benchmark
        report["checkpoint"] = run_checkpoint_benchmark(cfg.model, cfg.device, cfg.gen_batches, cfg.output_len,
                                                        cfg.repeats)
        print_checkpoint_report(report["checkpoint"])
    elif cfg.profile == "engine":
        from splitserve.bench.engine_steps import plot_engine_report, print_engine_report, run_engine_benchmark
        report["engine"] = run_engine_benchmark(
            cfg.shape, cfg.device, cfg.prefill_lens, cfg.batch_sizes, cfg.decode_context, cfg.hf_peer,
            cfg.gen_batches, gen_prompt=cfg.input_len, gen_new=cfg.output_len)
        print_engine_report(report["engine"])
        if cfg.plot:
            plot_engine_report(report["engine"], Path(cfg.plot))
    else:
        proc = None
        url = cfg.url
        if url is None:
            proc, url = start_local_server(cfg)
        try:
            report["http"] = http_load(url, cfg)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        if cfg.url is None:  # the peer: the same engine without HTTP, on the same prompts
            report["bare_engine"] = bare_engine_peer(cfg)
            report["http_over_engine"] = report["http"]["output_tokens_per_s"] / report["bare_engine"][
                "output_tokens_per_s"]
        print_report(report)
    write_report(report, cfg.output)
    if "chaos" in report:
        return 0 if report["chaos"]["hung"] == 0 else 1
    failed = report.get("http", {}).get("failed", 0)
    failed += sum(r["requests"] - r["ok"] for r in report.get("serving", {}).get("loads", []))
    failed += sum(r["requests"] - r["ok"] for e in report.get("api_split", {}).get("loads", [])
                  for r in e["served"].values())
    return 0 if failed == 0 else 1
