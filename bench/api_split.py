"""`splitserve bench --profile api-split`: what the HTTP path costs, with the engine in the server's
process and with the engine core in its own (`serve --engine-process`), against the bare engine.

One run, the same prompts for all three (each fixed load `--fixed-loads NxI:O`, all at once):
1. the bare engine in this process (no HTTP, no tokenizer), the peer;
2. `serve --no-engine-process`: HTTP server and engine loop in one process, sharing a GIL;
3. `serve --engine-process`: the engine core in a process of its own, over ZeroMQ IPC.
Each prints output tok/s, TTFT and ITL percentiles, and its output tok/s over the bare engine's.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch

logger = logging.getLogger(__name__)

MODES = {"one process": "--no-engine-process", "engine core process": "--engine-process"}


def bare_engine_load(folder: Path, device: str, max_running: int, engine_args: str, load, seed: int) -> dict:
    """The load's prompts submitted at once to an engine in this process (then stopped, its memory freed)."""
    from splitserve.api.serve_config import build_parser
    from splitserve.bench.workload import run_engine_batch
    from splitserve.config_flags import config_from_args
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine

    args = build_parser().parse_args(["--model", str(folder), "--load-format", "dummy", "--device", device,
                                      "--max-running-requests", str(max_running), "--disable-prefix-cache",
                                      *engine_args.split()])
    engine = Engine(config_from_args(EngineConfig, args, "SPLITSERVE"))
    engine.start()
    try:
        run_engine_batch(engine, [[1, 2, 3, 4]] * 2, 4)  # warm-up
        prompts = load_prompts(load, seed)
        return run_engine_batch(engine, prompts, load.output_lens[0])
    finally:
        engine.stop()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the servers that follow need the device's memory


def load_prompts(load, seed: int) -> list[list[int]]:
    """The prompts run_load sends for `load` (the same generator and order)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 250, (n,), generator=gen).tolist() for n in load.prompt_lens]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def served_load(folder: Path, device: str, max_running: int, engine_args: str, load, seed: int,
                client_processes: int) -> dict:
    """The load over HTTP; also the CPU time the server process (and its engine core, if it has one)
    spent per output token: the host work the HTTP path adds, which a faster device does not shrink."""
    from splitserve.bench.serving import run_load, start_server

    proc, url = start_server(folder, device, max_running, engine_args)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = run_load(url, model, type(load)("warm-up", [4] * 2, [4] * 2, [0.0] * 2, load.rate), seed, 1)
        if warm["ok"] != 2:
            raise RuntimeError(f"the server's warm-up requests failed: {warm['errors']}")
        pids = [proc.pid, *child_pids(proc.pid)]  # the API server, then its engine core (if split)
        before = [cpu_seconds(p) for p in pids]
        result = run_load(url, model, load, seed, client_processes)
        used = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
        tokens = max(1, result["output_tokens"])
        result["cpu_us_per_token"] = {"server": used[0] / tokens * 1e6,
                                      **({"engine_core": sum(used[1:]) / tokens * 1e6} if used[1:] else {})}
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_api_split_benchmark(cfg) -> dict[str, Any]:
    """The api-split profile for a BenchConfig (bench/command.py)."""
    from splitserve.bench.serving import fixed_load
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder

    folder = write_shape_folder(cfg.shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{cfg.shape}-")))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {"shape": cfg.shape, "device": device, "loads": []}
    for i, text in enumerate(cfg.fixed_loads):
        load = fixed_load(text)
        seed = cfg.seed + 100 + i
        bare = bare_engine_load(folder, device, cfg.max_running_requests, cfg.engine_args, load, seed)
        entry: dict[str, Any] = {"name": load.name, "bare_engine": bare, "served": {}}
        logger.info("%s bare engine: %.0f output tok/s", load.name, bare["output_tokens_per_s"])
        for mode, flags in MODES.items():
            result = served_load(folder, device, cfg.max_running_requests, f"{cfg.engine_args} {flags}", load, seed,
                                 cfg.client_processes)
            result["over_bare_engine"] = result["output_tok_s"] / bare["output_tokens_per_s"]
            entry["served"][mode] = result
            logger.info("%s %s: %.0f output tok/s, %.2f of the bare engine", load.name, mode,
                        result["output_tok_s"], result["over_bare_engine"])
        report["loads"].append(entry)
    return report


def print_api_split_report(report: dict[str, Any]) -> None:
    from splitserve.bench.load_client import client_line

    lines = [f"{report['shape']} on {report['device']}",
             "load            | path                      | ok      | out tok/s | / bare | TTFT p50/p90 ms | "
             "ITL p50/p90/p99 ms"]
    for entry in report["loads"]:
        bare = entry["bare_engine"]
        lines.append(f"{entry['name']:<15} | {'bare engine':<25} |         | {bare['output_tokens_per_s']:9.0f} |"
                     f"   1.00 | prefill {bare['prefill_s'] * 1e3:7.0f} | step {bare['decode_step_s'] * 1e3:.1f}")
        for mode, r in entry["served"].items():
            t, i = r["ttft_s"], r["itl_s"]
            lines.append(f"{entry['name']:<15} | HTTP, {mode:<19} | {r['ok']:>3}/{r['requests']:<3} | "
                         f"{r['output_tok_s']:9.0f} | {r['over_bare_engine']:6.2f} | {t['p50'] * 1e3:6.0f} "
                         f"{t['p90'] * 1e3:7.0f} | {i['p50'] * 1e3:5.1f} {i['p90'] * 1e3:5.1f} {i['p99'] * 1e3:6.1f}")
            lines.append(f"{'':<15}   {client_line(r['client'])}")
    lines.append("CPU time per output token (us): " + "; ".join(
        f"{entry['name']} {mode}: " + ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us_per_token"].items())
        for entry in report["loads"] for mode, r in entry["served"].items()))
    for line in lines:
        print(line)  # the report is the command's output
