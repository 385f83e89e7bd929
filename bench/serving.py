"""`splitserve bench --profile serving`: a server under open-loop load, against the bound from this
run's own measured limits.

One run:
1. the limits, measured here: device copy bandwidth, the runner's own prefill rate (the step of
   prompts of the median length packed as many as fit the step budget, and of one prompt of the
   budget's length; the budget being the larger of the engine's and the default, so that an engine
   given a smaller one is not measured against a lower bound), weight and KV bytes;
2. a server of the shape with random weights (its own process); the first request after its
   /health says ready, against the same request warm;
3. the loads: fixed lengths all at once (`--fixed-loads NxI:O`), and a seeded ShareGPT-like mix
   of prompt and output lengths arriving as a Poisson process at each of `--rates` (req/s;
   `inf`: all at once). Each prints output tok/s, TTFT and ITL percentiles, and the ratio of
   its output tok/s to the bound.

The bound of a load is the least time any engine on these limits needs for it: every prompt
token at the runner's best prefill rate, plus the decode steps at the HBM roofline: the weights
read once a step, at least ceil(output tokens / batch) steps and at least as many as the longest
output has tokens (a request's tokens come one a step), and every output token's KV read once; and
never less than any request's arrival plus its own prefill and decode at batch 1. (Before, the
steps were ceil(output / batch) alone and only the last arrival's own path counted: a mix whose
longest output outlasts the others' steps read as 0.34 of a bound no engine could reach.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from splitserve.engine.config import EngineConfig, default_max_running_requests

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """Requests with their prompt and output lengths and arrival times (s from the load's start)."""

    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    arrivals: list[float]
    rate: float  # requests/s offered (inf: all at once)


def parse_fixed_load(spec: str, flag: str = "--fixed-loads") -> tuple[int, int, int]:
    """'NxI:O' -> (N requests, I prompt tokens, O output tokens); `flag` names the option in the error."""
    try:
        count, rest = spec.lower().split("x")
        prompt_len, output_len = (int(v) for v in rest.split(":"))
        n = int(count)
    except ValueError:
        raise ValueError(f"{flag} {spec!r}: expected NxI:O, e.g. 256x512:256") from None
    if min(n, prompt_len, output_len) < 1:
        raise ValueError(f"{flag} {spec!r}: N, I and O must be >= 1")
    return n, prompt_len, output_len


def fixed_load(text: str, flag: str = "--fixed-loads") -> Load:
    """`NxI:O`: N prompts of I tokens, O output tokens each, all at once."""
    n, prompt, output = parse_fixed_load(text, flag)
    return Load(text, [prompt] * n, [output] * n, [0.0] * n, math.inf)


def sharegpt_like_load(n: int, rate: float, prompt_median: int, output_median: int, max_prompt: int,
                       max_output: int, seed: int) -> Load:
    """Lognormal prompt and output lengths around the given medians (ShareGPT's are heavy-tailed,
    their means well above their medians), Poisson arrivals at `rate`, all from one seed."""
    gen = torch.Generator().manual_seed(seed)
    prompts = (torch.randn(n, generator=gen) * 1.0).exp() * prompt_median
    outputs = (torch.randn(n, generator=gen) * 0.8).exp() * output_median
    gaps = torch.empty(n).exponential_(1.0, generator=gen) / rate if math.isfinite(rate) else torch.zeros(n)
    arrivals = (gaps.cumsum(0) - gaps[0]).tolist()
    return Load(f"sharegpt-like @ {rate:g} req/s", [int(min(max_prompt, max(4, p))) for p in prompts.tolist()],
                [int(min(max_output, max(1, o))) for o in outputs.tolist()], arrivals, rate)


@dataclass(frozen=True)
class Limits:
    """What bounds a load on this machine, all measured in this run."""

    copy_bandwidth_Bps: float
    prefill_tok_s: dict[int, float]  # the runner alone, prompts of each length packed into one step
    weight_bytes: int
    kv_bytes_per_token: int
    max_batch: int

    def decode_step_s(self, batch: int, context: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.copy_bandwidth_Bps

    def load_seconds(self, load: Load) -> float:
        """The least time the load can take (see the module docstring)."""
        rate = max(self.prefill_tok_s.values())
        n = len(load.prompt_lens)
        lengths = list(zip(load.prompt_lens, load.output_lens, strict=True))
        steps = max(-(-sum(load.output_lens) // min(n, self.max_batch)), max(load.output_lens))
        kv_read = sum(o * (p + o / 2) for p, o in lengths) * self.kv_bytes_per_token
        work = sum(load.prompt_lens) / rate + (steps * self.weight_bytes + kv_read) / self.copy_bandwidth_Bps
        alone = max(arrival + p / rate + (o - 1) * self.decode_step_s(1, p)
                    for arrival, (p, o) in zip(load.arrivals, lengths, strict=True))
        return max(work, alone)


def packed(length: int, budget: int) -> int:
    """How many fresh prompts of `length` tokens one step of `budget` tokens holds (at least one)."""
    return max(1, budget // length)


def measure_limits(shape: str, device: str, lengths: list[int], max_batch: int, budget: int) -> Limits:
    """The runner alone on this shape (then freed, so that the server gets the device's memory): at each
    length, the step of as many such prompts as fit `budget` tokens, packed, as an engine runs them."""
    from splitserve.bench.engine_steps import EngineUnderTest, device_limits

    most = max(packed(n, budget) for n in lengths)
    eut = EngineUnderTest(shape, device, max(8, most), max(n * packed(n, budget) for n in lengths) + 64 * most)
    limits = device_limits(eut.device, eut.runner.dtype)
    rates: dict[int, float] = {}
    for _ in range(2):  # the best of two passes: a fresh GPU may still be raising its clocks
        for n in lengths:
            prompts = packed(n, budget)
            rates[n] = max(rates.get(n, 0.0), n * prompts / eut.prefill_seconds(n, prompts=prompts))
    out = Limits(limits["copy_bandwidth_Bps"], rates, eut.weight_bytes, eut.kv_bytes_per_token, max_batch)
    eut.runner.close()
    del eut
    gc.collect()
    return out


def start_server(folder: Path, device: str, max_running: int, engine_args: str) -> tuple[subprocess.Popen, str]:
    from splitserve.launcher.up import free_port, wait_healthy

    port = free_port()
    cmd = [sys.executable, "-P", "-m", "splitserve", "serve", "--model", str(folder), "--load-format", "dummy",
           "--device", device, "--port", str(port), "--max-running-requests", str(max_running),
           "--disable-prefix-cache", *engine_args.split()]
    log = tempfile.NamedTemporaryFile(prefix="splitserve-bench-server-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([(url, proc)], timeout=600)
    except BaseException:
        proc.kill()
        proc.wait()
        tail = Path(log.name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the server did not start ({' '.join(cmd)}); its log ends:\n{tail}") from None
    return proc, url


def run_load(url: str, model: str, load: Load, seed: int, client_processes: int) -> dict[str, Any]:
    """Sends every request at its arrival time (open loop) from `client_processes` client workers and
    measures what each request's client saw, and how busy the busiest worker was."""
    from splitserve.bench.load_client import StreamRequest, client_summary, run_requests
    from splitserve.bench.stats import percentiles

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 250, (n,), generator=gen).tolist() for n in load.prompt_lens]
    requests = [StreamRequest(p, o, a) for p, o, a in zip(prompts, load.output_lens, load.arrivals, strict=True)]
    run = run_requests(url, model, requests, client_processes)
    timings, wall = run.timings, run.wall_s
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    return {"requests": len(timings), "ok": len(ok), "errors": sorted({t.error for t in timings if not t.ok})[:3],
            "wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "ttft_s": percentiles([t.ttft for t in ok]), "itl_s": percentiles([x for t in ok for x in t.itls]),
            "latency_s": percentiles([t.latency for t in ok]), "client": client_summary(run)}


async def first_request_after_ready(url: str, model: str, prompt_len: int) -> dict[str, float]:
    """The first request a fresh server serves, then the same one warm (each alone)."""
    from splitserve.bench.stream import completion_body, http_post, stream_completion

    prompt = [p % 250 + 1 for p in range(1, prompt_len + 1)]
    post = http_post(url, "/v1/completions", completion_body(model, prompt, 16))
    cold = await stream_completion(url, post, 16, timeout_s=600)
    warm = [await stream_completion(url, post, 16, timeout_s=600) for _ in range(3)]
    if not cold.ok or not all(t.ok for t in warm):
        raise RuntimeError(f"the first requests failed: {[t.error for t in (cold, *warm) if not t.ok]}")
    warm_s = statistics.median(t.latency for t in warm)
    return {"cold_s": cold.latency, "warm_s": warm_s, "cold_over_warm": cold.latency / warm_s}


def run_serving_benchmark(cfg) -> dict[str, Any]:
    """The serving profile for a BenchConfig (bench/command.py)."""
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder

    folder = write_shape_folder(cfg.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{cfg.shape}-")))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    loads = [fixed_load(x) for x in cfg.fixed_loads]
    loads += [sharegpt_like_load(cfg.num_requests, r, cfg.input_len, cfg.output_len, cfg.max_prompt_len,
                                 cfg.max_output_len, cfg.seed + i) for i, r in enumerate(cfg.rates)]
    median_prompt = int(statistics.median(p for load in loads for p in load.prompt_lens))
    # The engine's budget, but never below the default's: a smaller budget may make the engine slower, not its bound.
    budget = max(chunk_size(cfg.engine_args), EngineConfig().chunked_prefill_size)
    max_running = cfg.max_running_requests or default_max_running_requests(device)
    limits = measure_limits(cfg.shape, device, sorted({min(median_prompt, budget), budget}), max_running, budget)
    logger.info("limits: copy %.0f GB/s, runner prefill %s tok/s", limits.copy_bandwidth_Bps / 1e9,
                {k: round(v) for k, v in limits.prefill_tok_s.items()})
    report: dict[str, Any] = {"shape": cfg.shape, "device": device, "limits": dataclasses.asdict(limits),
                              "loads": []}
    proc, url = start_server(folder, device, max_running, cfg.engine_args)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        report["first_request"] = asyncio.run(first_request_after_ready(url, model, median_prompt))
        for i, load in enumerate(loads):
            result = run_load(url, model, load, cfg.seed + 100 + i, cfg.client_processes)
            bound_s = limits.load_seconds(load)
            result.update(name=load.name, rate=load.rate, input_tokens=sum(load.prompt_lens), bound_s=bound_s,
                          bound_output_tok_s=sum(load.output_lens) / bound_s)
            result["output_over_bound"] = result["output_tok_s"] / result["bound_output_tok_s"]
            report["loads"].append(result)
            logger.info("%s: %.0f output tok/s, %.2f of the bound", load.name, result["output_tok_s"],
                        result["output_over_bound"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return report


def chunk_size(engine_args: str) -> int:
    """The engine's chunked prefill size (its token budget per step) from the flags it gets."""
    words = engine_args.split()
    for i, word in enumerate(words):
        if word.startswith("--chunked-prefill-size"):
            return int(word.split("=", 1)[1] if "=" in word else words[i + 1])
    return EngineConfig().chunked_prefill_size


def print_serving_report(report: dict[str, Any]) -> None:
    from splitserve.bench.load_client import client_line

    fr = report["first_request"]
    lines = [f"{report['shape']} on {report['device']}: first request after ready {fr['cold_s'] * 1e3:.0f} ms, "
             f"warm {fr['warm_s'] * 1e3:.0f} ms ({fr['cold_over_warm']:.2f}x)",
             "load                      | ok      | out tok/s | bound tok/s | / bound | TTFT p50/p90/p99 ms     "
             "| ITL p50/p90/p99 ms"]
    for r in report["loads"]:
        t, i = r["ttft_s"], r["itl_s"]
        lines.append(f"{r['name']:<25} | {r['ok']:>3}/{r['requests']:<3} | {r['output_tok_s']:9.0f} | "
                     f"{r['bound_output_tok_s']:11.0f} | {r['output_over_bound']:7.2f} | "
                     f"{t['p50'] * 1e3:6.0f} {t['p90'] * 1e3:6.0f} {t['p99'] * 1e3:7.0f} | "
                     f"{i['p50'] * 1e3:5.1f} {i['p90'] * 1e3:5.1f} {i['p99'] * 1e3:6.1f}")
        lines.append(f"{'':<25}   {client_line(r['client'])}")
    for line in lines:
        print(line)  # the report is the command's output


def plot_serving_report(report: dict[str, Any], path: Path) -> bool:
    """Output tok/s (and the bound) and TTFT against the offered rate. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot (the JSON has the figures)")
        return False
    rated = [r for r in report["loads"] if r["name"].startswith("sharegpt")]
    if not rated:
        return False
    finite = [r["rate"] for r in rated if math.isfinite(r["rate"])]
    top = max(finite) * 2 if finite else 1.0
    xs = [r["rate"] if math.isfinite(r["rate"]) else top for r in rated]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, [r["output_tok_s"] for r in rated], "o-", label="measured")
    ax1.plot(xs, [r["bound_output_tok_s"] for r in rated], "k--", label="bound (this run's limits)")
    ax1.set_xlabel("offered request rate (req/s; last point: all at once)")
    ax1.set_ylabel("output tok/s")
    ax1.legend()
    for key, style in (("p50", "o-"), ("p90", "s--")):
        ax2.plot(xs, [r["ttft_s"][key] * 1e3 for r in rated], style, label=f"TTFT {key}")
    ax2.set_xlabel("offered request rate (req/s)")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.legend()
    fig.suptitle(f"{report['shape']} on {report['device']}: ShareGPT-like load")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
