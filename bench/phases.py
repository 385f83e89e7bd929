"""`splitserve bench --profile phases`: where the time to first token goes, 1P1D against unified, in one run.

The same seeded open-loop load (mixed lengths, at each --rates) goes through the router to one unified engine and
to one prefill + one decode engine. Every request asks the router for its phases (router/phases.py: the
`x-splitserve-phases` SSE comment); the report gives, per deployment and rate, the p50 of each phase, the client's
TTFT p50, and the attributed fraction (the phases' sum over the client's TTFT, per request: p50 and minimum).
The 1P1D-minus-unified difference of each phase's p50 says where disaggregation's extra TTFT goes. Then a burst
(--burst NxI:O, all sent at once) gives each deployment's output tok/s and TTFT under saturation.

  splitserve bench --profile phases --model tiny --device cpu --num-requests 40 --rates 4 --burst 16x128:32
  splitserve bench --profile phases --shape llama-3.1-8b --device cuda:0 --rates 8 16 24 \\
      --pd-engine-args "--transfer-protocol cuda_ipc"
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.load_client import client_line, default_client_processes
from splitserve.bench.report_file import write_report
from splitserve.bench.stats import percentiles
from splitserve.config_flags import add_config_flags, config_from_args
from splitserve.launcher.memory_split import KV_WEIGHTS
from splitserve.router.phases import DISAGGREGATED, PHASES_HEADER, UNIFIED

logger = logging.getLogger(__name__)

LABELS = {"unified": "unified", "1p1d": "1P1D"}
PROMPT_VOCAB = 300  # prompt ids are drawn below this: ids every model here has (the tiny model's vocabulary: 320)


@dataclass
class PhasesBenchConfig:
    """The load, and the two deployments it goes to."""

    model: str = field(default="tiny", metadata={"help": "checkpoint for the engines (ignored with --shape)"})
    shape: str = field(default="", metadata={
        "help": "a model shape with random weights (e.g. llama-3.1-8b) instead of --model"})
    device: str = field(default="auto", metadata={"help": "device of every engine (cuda:0: all on one GPU)"})
    rates: list[float] = field(default_factory=lambda: [8.0, 24.0], metadata={"help": "request rates (req/s)"})
    num_requests: int = field(default=200, metadata={"help": "requests per rate and deployment"})
    input_lens: list[int] = field(default_factory=lambda: [64, 2048], metadata={
        "help": "prompt lengths, drawn uniformly between the two (tokens)"})
    output_lens: list[int] = field(default_factory=lambda: [32, 512], metadata={
        "help": "output lengths, drawn uniformly between the two (tokens)"})
    deployments: list[str] = field(default_factory=lambda: ["unified", "1p1d"], metadata={
        "help": "which deployments to load, of unified and 1p1d (one alone: its figures, no comparison)"})
    engine_args: str = field(default="", metadata={"help": "extra flags for every engine"})
    pd_engine_args: str = field(default="", metadata={
        "help": "extra flags for the prefill and decode engines (e.g. --transfer-protocol cuda_ipc)"})
    burst: str = field(default="256x512:256", metadata={
        "help": "NxI:O: N prompts of I tokens sent at once, O tokens each, after the rates ('' skips it)"})
    client_processes: int = field(default_factory=default_client_processes, metadata={
        "help": "load generator worker processes (one event loop each; a busy one would time events late)"})
    mps: str = field(default="auto", metadata={
        "help": "CUDA MPS for the 1P1D engines on one GPU (splitserve up --mps: auto, on or off)"})
    mps_sm_percent: str = field(default="", metadata={
        "help": "the 1P1D engines' SM caps under MPS, ROLE=PERCENT[,...] (splitserve up --mps-sm-percent)"})
    mps_low_priority: str = field(default="auto", metadata={
        "help": "the 1P1D roles whose MPS clients run below normal priority: auto (the decode), none or ROLE[,...] "
                "(splitserve up --mps-low-priority)"})
    decode_kv_weight: float = field(default=KV_WEIGHTS["decode"], metadata={
        "help": "the decode's weight in the 1P1D engines' split of the GPU's KV memory, against the prefill's 1 "
                "(splitserve up --decode-kv-weight)"})
    warmup_requests: int = field(default=32, metadata={
        "help": "requests sent at the first rate before any is measured, with prompts of their own (CUDA graphs, "
                "allocator, connections warm; a cold first rate measured the start)"})
    seed: int = field(default=0, metadata={"help": "seed of the prompts, lengths and arrival times"})
    output: str = field(default="", metadata={"help": "write the figures as JSON here"})


@dataclass(frozen=True)
class Sample:
    """One request: the client's TTFT and the router's phases (None: the router sent none)."""

    ttft: float
    phases: dict[str, float] | None
    error: str | None = None
    tokens: int = 0  # output tokens the client received
    itls: tuple[float, ...] = ()  # the client's gaps between token events


def workload(cfg: PhasesBenchConfig, vocab: int, part: str, num_requests: int | None = None,
             ) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt ids, max tokens) per request, seeded by the bench's seed and `part` (the warm-up,
    each rate): each part's prompts are its own, so no part finds another's in a prefix cache. Poisson arrivals at
    rate 1 (scaled later)."""
    rng = random.Random(f"{cfg.seed}/{part}")
    lo, hi = sorted(cfg.input_lens[:2]) if len(cfg.input_lens) > 1 else (cfg.input_lens[0],) * 2
    olo, ohi = sorted(cfg.output_lens[:2]) if len(cfg.output_lens) > 1 else (cfg.output_lens[0],) * 2
    t, out = 0.0, []
    for _ in range(cfg.num_requests if num_requests is None else num_requests):
        t += rng.expovariate(1.0)
        out.append((t, [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi)))
    return out


def run_load(url: str, model: str, requests: list[tuple[float, list[int], int]], rate: float,
             client_processes: int) -> tuple[list[Sample], dict[str, Any], float]:
    """Sends each request at its offset / rate (open loop) from the bench's client workers (bench/load_client.py),
    each asking the router for its phases; (one Sample per request, the client's own figures, the load's wall
    time from its start to its last token)."""
    from splitserve.bench.load_client import StreamRequest, client_summary, run_requests

    load = [StreamRequest(prompt, max_tokens, offset / rate) for offset, prompt, max_tokens in requests]
    run = run_requests(url, model, load, client_processes, timeout_s=600, headers={PHASES_HEADER: "1"})
    samples = [Sample(t.ttft, t.phases, tokens=t.output_tokens, itls=tuple(t.itls)) if t.ok
               else Sample(0.0, None, t.error)
               for t in run.timings]
    return samples, client_summary(run), run.wall_s


def summarize(samples: list[Sample], names: list[str]) -> dict[str, Any]:
    """p50 of each phase and of the client's TTFT; the attributed fraction per request (p50, minimum)."""
    ok = [s for s in samples if s.error is None]
    told = [s for s in ok if s.phases is not None]
    fractions = [sum(s.phases.values()) / s.ttft for s in told if s.ttft > 0]  # type: ignore[union-attr]
    return {
        "requests": len(samples), "ok": len(ok), "with_phases": len(told),
        "errors": sorted({s.error for s in samples if s.error})[:3],
        "ttft_s": percentiles([s.ttft for s in ok]),
        "itl_s": percentiles([x for s in ok for x in s.itls]),
        "phases_p50_s": {n: percentiles([s.phases.get(n, 0.0) for s in told])["p50"]  # type: ignore[union-attr]
                         for n in names},
        "attributed_p50": percentiles(fractions)["p50"], "attributed_min": min(fractions, default=float("nan")),
    }


def burst_requests(spec: str, vocab: int, seed: int) -> list[tuple[float, list[int], int]]:
    """N requests at offset 0 (all at once), each of I seeded prompt tokens and O output tokens."""
    from splitserve.bench.serving import parse_fixed_load

    n, prompt_len, output_len = parse_fixed_load(spec, "--burst")
    rng = random.Random(f"{seed}/burst")
    return [(0.0, [rng.randrange(10, vocab) for _ in range(prompt_len)], output_len) for _ in range(n)]


def summarize_burst(samples: list[Sample], seconds: float) -> dict[str, Any]:
    """Output tok/s over the whole burst (first send to last token), and its TTFT percentiles."""
    ok = [s for s in samples if s.error is None]
    return {"requests": len(samples), "ok": len(ok), "errors": sorted({s.error for s in samples if s.error})[:3],
            "seconds": seconds, "output_tok_s": sum(s.tokens for s in ok) / seconds if seconds > 0 else 0.0,
            "ttft_s": percentiles([s.ttft for s in ok]), "itl_s": percentiles([x for s in ok for x in s.itls])}


def counter_total(metrics_text: str, name: str) -> float:
    """The sum over labels of a counter in a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics_text) if family.name == name
               for sample in family.samples if sample.name == f"{name}_total")


def engine_preemptions(deployment: Any) -> dict[str, float]:
    """Each engine's preemptions so far (`splitserve_preemptions_total`): a decode or unified engine short of KV
    pages computes the prompts of the requests it preempted again, on the GPU the others use."""
    return {c.name: counter_total(httpx.get(f"{c.url}/metrics", timeout=10).text, "splitserve_preemptions")
            for c in deployment.engines}


def supervise(deployment: Any, stop: list[bool]) -> None:
    """The deployment's supervision (`up`'s restarts and liveness checks) until `stop[0]`; says so if it fails."""
    try:
        deployment.watch(stop)
    except Exception:
        logger.exception("supervising the deployment failed: engines that die are no longer restarted")


def run_phases_benchmark(cfg: PhasesBenchConfig) -> dict[str, Any]:
    from splitserve.launcher.up import Deployment, UpConfig, free_port

    if cfg.burst:
        burst_requests(cfg.burst, PROMPT_VOCAB, cfg.seed)  # a bad spec fails now, not after the first deployment
    unknown = set(cfg.deployments) - {"unified", "1p1d"}
    if unknown or not cfg.deployments:
        raise ValueError(f"--deployments takes unified and/or 1p1d, not {sorted(unknown) or 'nothing'}")

    model = cfg.model
    if cfg.shape:
        import tempfile

        from splitserve.engine.checkpoints.model_shapes import write_shape_folder
        model = str(write_shape_folder(cfg.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{cfg.shape}-"))))
        cfg = dataclasses.replace(cfg, engine_args=f"--load-format dummy {cfg.engine_args}".strip())  # random weights
    report: dict[str, Any] = {"config": asdict(cfg), "unified": {}, "1p1d": {}, "mps_gpus": {}, "restarts": {}}
    shapes = (("unified", {"unified": 1}, [p for p, _, _ in UNIFIED], cfg.engine_args),
              ("1p1d", {"prefill": 1, "decode": 1}, [p for p, _, _ in DISAGGREGATED],
               f"{cfg.engine_args} {cfg.pd_engine_args}".strip()))
    for name, shape, names, engine_args in shapes:
        if name not in cfg.deployments:
            continue
        deployment = Deployment(UpConfig(model=model, device=cfg.device, port=free_port(), engine_args=engine_args,
                                         mps=cfg.mps if name == "1p1d" else "off",
                                         mps_sm_percent=cfg.mps_sm_percent if name == "1p1d" else "",
                                         mps_low_priority=cfg.mps_low_priority if name == "1p1d" else "none",
                                         decode_kv_weight=cfg.decode_kv_weight,
                                         **shape))  # one engine
        stop = [False]  # the deployment is supervised as under `up`: an engine that dies is restarted
        supervisor = threading.Thread(target=supervise, args=(deployment, stop), name="supervisor", daemon=True)
        try:
            url = deployment.start()
            supervisor.start()
            report["mps_gpus"][name] = deployment.mps.gpus if deployment.mps else []
            served = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
            if cfg.warmup_requests > 0 and cfg.rates:
                warmup = workload(cfg, PROMPT_VOCAB, "warmup", cfg.warmup_requests)
                run_load(url, served, warmup, cfg.rates[0], cfg.client_processes)
            for i, rate in enumerate(cfg.rates):
                # Prompts of this rate's own: the same prompts again would be prefix-cache hits at every later rate.
                requests = workload(cfg, PROMPT_VOCAB, f"rate{i}")
                before = engine_preemptions(deployment)
                samples, client, _ = run_load(url, served, requests, rate, cfg.client_processes)
                after = engine_preemptions(deployment)
                report[name][rate] = {**summarize(samples, names), "client": client,
                                      "preemptions": {e: after[e] - before.get(e, 0.0) for e in after}}
                logger.info("%s at %g req/s: TTFT p50 %.1f ms, %d/%d ok", name, rate,
                            report[name][rate]["ttft_s"]["p50"] * 1e3, report[name][rate]["ok"], cfg.num_requests)
                write_report(report, cfg.output)  # what a cut run measured so far
            if cfg.burst:
                burst = burst_requests(cfg.burst, PROMPT_VOCAB, cfg.seed)
                samples, client, seconds = run_load(url, served, burst, 1.0, cfg.client_processes)
                report[name]["burst"] = {**summarize_burst(samples, seconds), "client": client}
                logger.info("%s burst %s: %.0f output tok/s", name, cfg.burst, report[name]["burst"]["output_tok_s"])
                write_report(report, cfg.output)
        finally:
            stop[0] = True
            if supervisor.is_alive():
                supervisor.join()  # no restart may race the stop
            report["restarts"][name] = {c.name: c.restarts for c in deployment.children if c.restarts}
            deployment.stop()
    return report


def print_phases_report(report: dict[str, Any]) -> None:
    mps = report.get("mps_gpus", {}).get("1p1d")
    print(f"1P1D engines: {'one MPS server on ' + ', '.join(mps) if mps else 'no MPS'} "
          f"(--mps {report['config'].get('mps', 'auto')})")
    for name, counts in report.get("restarts", {}).items():
        if counts:  # the figures after a restart include the outage
            print(f"{name}: restarted during the run: " + ", ".join(f"{c} x{n}" for c, n in counts.items()))
    for rate in report["config"]["rates"]:
        ran = [(name, report[name][rate]) for name in ("unified", "1p1d") if rate in report[name]]
        if not ran:
            continue
        print(f"rate {rate:g} req/s: TTFT p50 " + ", ".join(
            f"{LABELS[name]} {r['ttft_s']['p50'] * 1e3:.1f} ms ({r['ok']}/{r['requests']} ok)" for name, r in ran))
        print("  ITL p50 / p99: " + ", ".join(
            f"{LABELS[name]} {r['itl_s']['p50'] * 1e3:.1f} / {r['itl_s']['p99'] * 1e3:.1f} ms" for name, r in ran
            if "itl_s" in r))
        for name, r in ran:
            print(f"  {name:>8}: attributed p50 {r['attributed_p50']:.3f}, min {r['attributed_min']:.3f} "
                  f"({r['with_phases']} with phases)")
            if any(r.get("preemptions", {}).values()):  # requests computed twice: the figures include it
                print(f"  {name:>8}: preempted " + ", ".join(f"{int(n)} on {e}" for e, n in r["preemptions"].items()
                                                         if n))
        uni, pd = report["unified"].get(rate), report["1p1d"].get(rate)
        if uni is not None and pd is not None:
            print(f"  {'phase':>16} {'unified p50':>12} {'1P1D p50':>10} {'1P1D - unified':>15}")
            for phase in pd["phases_p50_s"]:
                u = uni["phases_p50_s"].get(phase)
                p = pd["phases_p50_s"][phase]
                diff = f"{(p - u) * 1e3:+12.2f} ms" if u is not None else f"{p * 1e3:+12.2f} ms"
                print(f"  {phase:>16} {'' if u is None else f'{u * 1e3:9.2f} ms':>12} {p * 1e3:7.2f} ms {diff:>15}")
        else:
            name, r = ran[0]
            print(f"  {'phase':>16} {LABELS[name] + ' p50':>12}")
            for phase, v in r["phases_p50_s"].items():
                print(f"  {phase:>16} {v * 1e3:9.2f} ms")
    for name in ("unified", "1p1d"):
        other = "1p1d" if name == "unified" else "unified"
        if "burst" in report[name] and "burst" not in report[other]:
            b = report[name]["burst"]
            print(f"burst {report['config']['burst']}: output {b['output_tok_s']:.0f} tok/s {LABELS[name]}; TTFT p50 "
                  f"{b['ttft_s']['p50']:.2f} s ({b['ok']}/{b['requests']} ok)")
    if "burst" in report["unified"] and "burst" in report["1p1d"]:
        uni, pd = report["unified"]["burst"], report["1p1d"]["burst"]
        ratio = pd["output_tok_s"] / uni["output_tok_s"] if uni["output_tok_s"] else float("nan")
        print(f"burst {report['config']['burst']}: output {uni['output_tok_s']:.0f} tok/s unified, "
              f"{pd['output_tok_s']:.0f} 1P1D ({ratio:.2f}x); TTFT p50 {uni['ttft_s']['p50']:.2f} s against "
              f"{pd['ttft_s']['p50']:.2f} s ({uni['ok']}/{uni['requests']} and {pd['ok']}/{pd['requests']} ok)")
    loads = [r for name in ("unified", "1p1d") for r in report[name].values() if "client" in r]
    if loads:  # the busiest load's client: the figures are only as good as its timing of events
        print(client_line(max((r["client"] for r in loads), key=lambda c: c["busy_max"])))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile phases", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, PhasesBenchConfig, "SPLITSERVE_BENCH")
    cfg = config_from_args(PhasesBenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH")
    report = run_phases_benchmark(cfg)
    print_phases_report(report)
    write_report(report, cfg.output)
    failed = sum(r["requests"] - r["ok"] for name in ("unified", "1p1d") for r in report[name].values())
    return 0 if failed == 0 else 1
