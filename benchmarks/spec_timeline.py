"""Where a drafter's and its verifier's time goes when they share one GPU (speculative decoding), step by step.

  python3 -P benchmarks/spec_timeline.py --shape llama-3.1-8b --ks 2 4 --output-len 128 --json OUT.json

The target and the exact drafter of `bench --profile spec` (bench/spec.py). First the drafter
model alone in this process, at batch 1: without the overlap scheduler (the host's time between its
steps shows) and with the drafter's engine settings (overlap on: its steps back to back on the device).
Then the verifier in this process and a `serve --role drafter` process (this script again, with the
same step trace installed) on the same device, the gate off (every step speculates), batch 1, each K:
for every step of each process the host's time polling (the verifier's wait for drafts apart), in
launch, waiting for the step's tokens and completing it, and the step's span on the device (CUDA
events around it); for the drafter also when a verifier's batch arrived and when drafted tokens went
out. Host times are CLOCK_MONOTONIC in both processes, so the two traces merge into one timeline
(`--json` keeps every record). Last, plain decoding at --plain-batches without and with
batch-invariant attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from splitserve.bench import spec as bench_spec
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG
from splitserve.engine.engine import Engine

logger = logging.getLogger("spec_timeline")


class StepTrace:
    """Records (monotonic time, what, value) around the engine's step phases, in any process."""

    def __init__(self) -> None:
        self.records: list[tuple[float, str, float]] = []
        self.cuda = torch.cuda.is_available()

    def mark(self, what: str, value: float = 0.0) -> None:
        self.records.append((time.monotonic(), what, value))

    def install(self) -> None:
        """Wraps Engine's launch/complete, the roles' poll and the drafter's message handling."""
        from splitserve.engine.roles.drafter import DrafterRole
        from splitserve.engine.roles.verifier import VerifierRole
        from splitserve.engine.runner.model_runner import PendingStep

        trace = self
        launch, complete, result = Engine._launch, Engine._complete, PendingStep.result

        def traced_launch(engine: Engine, chunks):  # type: ignore[no-untyped-def]
            start = end = None
            if trace.cuda and engine.runner.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            trace.mark("launch0", len(chunks))
            step = launch(engine, chunks)
            trace.mark("launch1", sum(len(c.draft) for c in chunks))
            if start is not None and step is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                step.pending.timing = (start, end)  # type: ignore[attr-defined]
            return step

        def traced_complete(engine: Engine, step) -> None:  # type: ignore[no-untyped-def]
            trace.mark("complete0")
            complete(engine, step)
            timing = getattr(step.pending, "timing", None)
            trace.mark("complete1", timing[0].elapsed_time(timing[1]) if timing else 0.0)
            trace.mark("generated", engine.metrics.generation_tokens._value.get())

        def traced_result(pending):  # type: ignore[no-untyped-def]
            out = result(pending)
            trace.mark("result")
            return out

        Engine._launch, Engine._complete, PendingStep.result = traced_launch, traced_complete, traced_result
        for role in (VerifierRole, DrafterRole):
            role.poll = self._around(role.poll, "poll")  # type: ignore[method-assign]
        VerifierRole._wait_for_drafts = self._around(VerifierRole._wait_for_drafts, "wait")  # type: ignore
        DrafterRole.apply = self._around(DrafterRole.apply, "apply")  # type: ignore[method-assign]
        DrafterRole._send = self._around(DrafterRole._send, "send")  # type: ignore[method-assign]

    def _around(self, fn, what: str):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.mark(what + "0")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(what + "1")
        return wrapped

    def dump_every(self, path: Path, seconds: float = 0.5) -> None:
        """Writes the records to `path` now and then (a drafter process is stopped, not ended)."""
        def loop() -> None:
            while True:
                time.sleep(seconds)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(list(self.records)))
                tmp.replace(path)
        threading.Thread(target=loop, name="trace-dump", daemon=True).start()


def summarize(records: list[tuple[float, str, float]], t0: float, t1: float) -> dict[str, Any]:
    """Per step means (ms) of one process's phases within [t0, t1]: steps, the period between launches,
    poll (wait for drafts apart), wait for drafts, launch, wait for tokens, the rest of completing, the
    device span; for a drafter, batches received and token sends."""
    recs = [r for r in records if t0 <= r[0] <= t1]
    opened: dict[str, float] = {}
    spans: dict[str, list[float]] = {}
    device: list[float] = []
    launches: list[float] = []
    results: list[float] = []
    for t, what, value in recs:
        if what.endswith("0"):
            opened[what[:-1]] = t
            if what == "launch0":
                launches.append(t)
            continue
        if what == "result":
            if "complete" in opened:
                spans.setdefault("tokens_wait", []).append(t - opened["complete"])
                opened["after_result"] = t
            results.append(t)
            continue
        base = what[:-1]
        if base in opened:
            spans.setdefault(base, []).append(t - opened.pop(base))
        if what == "complete1":
            if "after_result" in opened:
                spans.setdefault("complete_rest", []).append(t - opened.pop("after_result"))
            if value:
                device.append(value)
    out: dict[str, Any] = {"steps": len(launches), "seconds": t1 - t0}
    if len(launches) > 1:
        out["period_ms"] = 1e3 * statistics.mean(b - a for a, b in itertools.pairwise(launches))
    for name, values in spans.items():
        out[f"{name}_ms"] = 1e3 * sum(values) / max(len(launches), 1)
        out[f"{name}_count"] = len(values)
    if device:
        out["device_span_ms"] = statistics.mean(device)
        out["device_span_median_ms"] = statistics.median(device)
    return out


def step_table(records: list[tuple[float, str, float]], t0: float, t1: float) -> list[dict[str, float]]:
    """One row per step launched within [t0, t1] (the verifier's): when it was launched (ms after t0),
    the time to the next launch, drafts it verified, the host's wait for drafts before it, and, once it
    completed (under overlap after the next launch), its device span and the tokens emitted."""
    rows: list[dict[str, float]] = []
    pending: list[int] = []  # rows launched and not completed yet, oldest first
    wait_open, waited, generated = None, 0.0, None
    for t, what, value in records:
        if what == "generated" and t < t0:
            generated = value
        if not t0 <= t <= t1:
            continue
        if what == "wait0":
            wait_open = t
        elif what == "wait1" and wait_open is not None:
            waited += t - wait_open
            wait_open = None
        elif what == "launch0":
            if rows:
                rows[-1]["period_ms"] = 1e3 * (t - t0) - rows[-1]["t_ms"]
            rows.append({"t_ms": 1e3 * (t - t0), "waited_ms": 1e3 * waited, "drafts": 0, "device_ms": 0.0,
                         "tokens": 0})
            pending.append(len(rows) - 1)
            waited = 0.0
        elif what == "launch1" and rows:
            rows[-1]["drafts"] = int(value)
        elif what == "complete1" and pending:
            done = pending.pop(0)
            rows[done]["device_ms"] = value
            rows[done]["completed"] = 1
        elif what == "generated":
            if generated is not None and rows:
                done = next((i for i in range(len(rows) - 1, -1, -1) if rows[i].get("completed")), len(rows) - 1)
                rows[done]["tokens"] += int(value - generated)
            generated = value
    if rows:
        rows[-1]["period_ms"] = 1e3 * (t1 - t0) - rows[-1]["t_ms"]
    return rows


def split_at_first_verify(rows: list[dict[str, float]], plain_tokens_per_s: float) -> dict[str, Any]:
    """The steps before the first one that verified drafts (the drafter taking the requests in) and
    from it on: steps, ms, tokens, ms waited for drafts, and ms lost against plain decoding's rate
    (negative: saved)."""
    first = next((i for i, r in enumerate(rows) if r["drafts"]), len(rows))
    out: dict[str, Any] = {}
    for name, part in (("before_first_verify", rows[:first]), ("from_first_verify", rows[first:])):
        ms = sum(r.get("period_ms", 0.0) for r in part)
        tokens = sum(r["tokens"] for r in part)
        out[name] = {"steps": len(part), "ms": round(ms, 2), "tokens": tokens,
                     "waited_ms": round(sum(r["waited_ms"] for r in part), 2),
                     "device_ms": round(sum(r["device_ms"] for r in part), 2),
                     "lost_ms": round(ms - 1e3 * tokens / plain_tokens_per_s, 2)}
    return out


def drafter_alone(folder: Path, device: str, prompt_len: int, output_len: int, trace: StepTrace) -> dict[str, Any]:
    """The drafter model at batch 1 on its own: without the overlap scheduler, then with the drafter's
    settings (overlap on, its default)."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.roles.drafter import drafter_engine_config
    from splitserve.engine.sampling_params import SamplingParams

    report = {}
    prompts = bench_spec.random_prompts(1, prompt_len, seed=7)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    base = EngineConfig(model=str(folder), device=device, max_total_tokens=8192, max_running_requests=8)
    for name, cfg in (("no_overlap", drafter_engine_config(base, overlap=False)),
                      ("drafter_overlap", drafter_engine_config(base, overlap=True))):
        engine = Engine(cfg)
        engine.use_row_invariant_rows(None)  # as a drafter does
        engine.start()
        try:
            generate_tokens(engine, prompts, SamplingParams(max_new_tokens=8))
            t0 = time.monotonic()
            generate_tokens(engine, prompts, params)
            t1 = time.monotonic()
        finally:
            engine.stop()
        report[name] = {"tokens_per_s": output_len / (t1 - t0), **summarize(trace.records, t0, t1)}
        logger.info("drafter alone, %s: %.1f tok/s, %s", name, report[name]["tokens_per_s"],
                    {k: round(v, 3) for k, v in report[name].items() if k.endswith("_ms")})
        if device == "cuda":
            torch.cuda.empty_cache()
    return report


def plain_rates(engine: Engine, batches: list[int], prompt_len: int, output_len: int) -> dict[int, float]:
    """Plain decoding tok/s at each batch (its prompts run once first: prefix-cached as later)."""
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

    rates = {}
    for b in batches:
        prompts = bench_spec.random_prompts(b, prompt_len, seed=b)
        generate_tokens(engine, prompts, SamplingParams(max_new_tokens=4))
        t0 = time.monotonic()
        generate_tokens(engine, prompts, SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
        rates[b] = b * output_len / (time.monotonic() - t0)
        logger.info("plain batch %d (batch-invariant attention %s): %.1f tok/s", b,
                    engine.runner.batch_invariant_attention, rates[b])
    return rates


def start_py_spy(folder: str | None, pids: dict[str, int], seconds: int) -> list:  # type: ignore[type-arg]
    """py-spy records (raw, non-blocking) of each pid into `folder`, if py-spy is installed."""
    import shutil
    import subprocess

    if not folder or shutil.which("py-spy") is None:
        return []
    Path(folder).mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(["py-spy", "record", "--nonblocking", "--threads", "--rate", "1000", "--format", "raw",
                              "--duration", str(seconds), "--pid", str(pid), "-o", f"{folder}/pyspy_{name}.txt"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for name, pid in pids.items()]


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--as-drafter":  # the drafter process: trace, then `splitserve ...`
        trace = StepTrace()
        trace.install()
        trace.dump_every(Path(argv[1]))
        from splitserve.cli import main as cli_main

        return cli_main(argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="decode batch of the runs with the drafter")
    parser.add_argument("--gate", nargs="+", choices=["off", "on"], default=["off"],
                        help="each K with the speculation gate off (every step speculates) and/or on (after a K=0 "
                             "run at the batch, as the bench's cells: the gate's plain rate there)")
    parser.add_argument("--no-alone", action="store_true", help="skip the drafter model alone")
    parser.add_argument("--draft-wait-ms", type=float, nargs="+", default=[4.0],
                        help="the verifier's --draft-wait-ms; several: each K and gate with each")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plain-batches", type=int, nargs="*", default=[8, 32],
                        help="plain decoding tok/s at these batches, without and then with batch-invariant attention")
    parser.add_argument("--py-spy", default=None, help="folder: py-spy records of both processes during the K runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from splitserve.draft_mesh import SpecConfig
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.role import ComposedRole
    from splitserve.engine.roles.verifier import VerifierRole
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer import TransferConfig

    work = Path(args.workdir or tempfile.mkdtemp(prefix="spec-timeline-"))
    # "spec-tiny": the tiny model's layers, 8 deep: on a CPU its steps cost little beside the host's work.
    shape = {**bench_spec.BENCH_SHAPES, "spec-tiny": {**TINY_CONFIG, "num_hidden_layers": 8}}[args.shape]
    folders = bench_spec.spec_checkpoints(shape, work, 4, 0, "cuda" if args.device == "cuda" else "cpu")
    trace = StepTrace()
    trace.install()
    report: dict[str, Any] = {"args": vars(args)}
    if not args.no_alone:
        report["alone"] = drafter_alone(folders["exact"], args.device, args.prompt_len, args.output_len, trace)
    mesh_port = bench_spec.free_port()
    spec = SpecConfig(drafter=[f"127.0.0.1:{mesh_port}"], num_draft_tokens=max(args.ks),
                      draft_wait_ms=args.draft_wait_ms[0], speculation_gate=False)
    verifier = VerifierRole(spec, TransferConfig(transfer_control_key=bench_spec.KEY))
    engine = Engine(EngineConfig(model=str(folders["target"]), device=args.device, max_total_tokens=16384,
                                 max_running_requests=max([8, args.batch, *args.plain_batches])),
                    role=ComposedRole("unified", [verifier]))
    engine.start()
    drafter_trace = work / "drafter-trace.json"
    # The bench's prompts at this batch (bench_spec: seed = batch).
    prompts = bench_spec.random_prompts(args.batch, args.prompt_len, seed=args.batch)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        from splitserve.engine.offline import generate_tokens

        generate_tokens(engine, prompts, SamplingParams(max_new_tokens=4))
        t0 = time.monotonic()
        plain = generate_tokens(engine, prompts, params)
        report["plain"] = {"tokens_per_s": args.batch * args.output_len / (time.monotonic() - t0),
                           **summarize(trace.records, t0, time.monotonic())}
        logger.info("plain batch %d: %.1f tok/s", args.batch, report["plain"]["tokens_per_s"])
        report["plain_batches"] = plain_rates(engine, args.plain_batches, args.prompt_len, args.output_len)
        http_port = bench_spec.free_port()
        log = work / "drafter.log"
        cmd = [sys.executable, "-P", os.path.abspath(__file__), "--as-drafter", str(drafter_trace), "serve",
               "--role", "drafter", "--model", str(folders["exact"]), "--device", args.device, "--port",
               str(http_port), "--draft-mesh-port", str(mesh_port), "--max-total-tokens", "16384",
               "--max-draft-ahead", str(2 * max(args.ks) + 1), "--max-running-requests", str(max(8, args.batch))]
        env = {**os.environ, "SPLITSERVE_TRANSFER_CONTROL_KEY": bench_spec.KEY, "PYTHONUNBUFFERED": "1"}
        import subprocess

        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        try:
            bench_spec.wait_joined(verifier, proc)
            deadline = time.monotonic() + 120
            while True:  # its HTTP server comes up after the mesh
                try:
                    bench_spec.drafter_drafted(http_port)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            for k in args.ks:  # as the bench: a short pass at each K, every step speculating, first
                verifier.num_draft_tokens = k
                generate_tokens(engine, prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
            windows = []
            spies = start_py_spy(args.py_spy, {"verifier": os.getpid(), "drafter": proc.pid},
                                 len(args.ks) * len(args.gate) * len(args.draft_wait_ms) * 4)
            for k, wait, gate in itertools.product(args.ks, args.draft_wait_ms, args.gate):
                verifier.spec = dataclasses.replace(spec, speculation_gate=gate == "on", draft_wait_ms=wait)
                peer = None
                if gate == "on":  # as a bench cell: what speculating measured is forgotten, a K=0 run
                    verifier.gate.forget_speculation()
                    verifier.num_draft_tokens = 0
                    peer = bench_spec.decode_run(engine, prompts, args.output_len)["tokens_per_s"]
                verifier.num_draft_tokens = k
                t0 = time.monotonic()
                run = bench_spec.decode_run(engine, prompts, args.output_len, verifier, http_port)
                t1 = time.monotonic()
                same = run.pop("outputs") == plain
                run["gate_summary"] = verifier.gate.summary()
                windows.append((k, wait, gate, peer, t0, t1, run, same))
            time.sleep(1.5)  # the drafter's trace is written every 0.5 s
            for spy in spies:
                spy.send_signal(signal.SIGINT)  # py-spy writes its record on SIGINT
                spy.wait(timeout=30)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        drafter_records = json.loads(drafter_trace.read_text())
        report["runs"] = []
        for k, wait, gate, peer, t0, t1, run, same in windows:
            steps = step_table(trace.records, t0, t1)
            row = {"k": k, "batch": args.batch, "gate": gate, "draft_wait_ms": wait, "identical_to_plain": same,
                   **{n: run[n] for n in ("tokens_per_s", "steps", "drafted", "accepted", "verify_steps", "waited_s",
                                          "drafter_drafted", "speculating_steps", "plain_steps", "gate_switches",
                                          "gate_saved_s", "gate_summary")},
                   "speedup": run["tokens_per_s"] / report["plain"]["tokens_per_s"], "peer_tokens_per_s": peer,
                   "parts": split_at_first_verify(steps, report["plain"]["tokens_per_s"]), "step_table": steps,
                   "verifier": summarize(trace.records, t0, t1), "drafter": summarize(drafter_records, t0, t1)}
            report["runs"].append(row)
            logger.info("K=%d batch %d wait %.0f ms gate %s: %.1f tok/s (x%.2f of plain%s), %d steps (%d speculating, "
                        "%d verified), waited %.1f ms, drafter drafted %s, gate switches %s, saved %.1f ms", k,
                        args.batch, wait, gate,
                        run["tokens_per_s"], row["speedup"], f", x{run['tokens_per_s'] / peer:.2f} of the K=0 run"
                        if peer else "", run["steps"], run["speculating_steps"], run["verify_steps"],
                        1e3 * run["waited_s"], run["drafter_drafted"], run["gate_switches"] or "none",
                        1e3 * run["gate_saved_s"])
            logger.info("  parts: %s", row["parts"])
            logger.info("  steps (t_ms, period_ms, drafts, waited_ms, device_ms, tokens): %s",
                        [(round(r["t_ms"], 1), round(r.get("period_ms", 0.0), 2), r["drafts"], round(r["waited_ms"], 2),
                          round(r["device_ms"], 2), r["tokens"]) for r in steps])
            for side in ("verifier", "drafter"):
                logger.info("  %s: %s", side, {n: round(v, 3) if isinstance(v, float) else v
                                               for n, v in row[side].items()})
        if args.json:
            report["trace"] = {"verifier": [r for r in trace.records if r[0] >= windows[0][4]],
                               "drafter": [r for r in drafter_records if r[0] >= windows[0][4]]}
        if args.plain_batches:
            bench_spec.set_invariance(engine, engine.runner.row_invariant_rows, True)
            report["plain_batches_batch_invariant"] = plain_rates(engine, [1, *args.plain_batches], args.prompt_len,
                                                                  args.output_len)
    finally:
        engine.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "trace"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
