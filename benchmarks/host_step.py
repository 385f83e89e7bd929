"""The engine thread's host work per decode step, per row, by phase (CPU or CUDA).

  python3 -P benchmarks/host_step.py --shape tiny --requests 256 --prompt-len 32 --output-len 128
      [--vocab 128256] [--device cpu] [--sink collect core] [--audit-hook] [--profile loop.prof]

Runs bursts of greedy requests (all at once) through one started engine and times each loop turn's
schedule, launch (batch building and queueing) and completion (reading the tokens back, stops,
detokenization, outputs, page accounting), and the rest of the turn (inbox, snapshot, gauges, the
after-step hook), in the loop thread's CPU time (on a shared machine wall time also counts waits for
a core) and in wall time. The device's share is taken out: the wait for a step's tokens, and on a CPU
the model's forward and sampling. Reported for the steps that decode every request at once, medians
per step and per row: a tiny model on a CPU shows the Python cost a large model on a GPU pays too.
`--vocab` widens the tiny model's vocabulary (ids past the byte-level tokenizer's decode to nothing,
as random weights of a real shape emit). `--sink`: one burst per sink; `core` sends every output as
the engine core process does (its OutputSink: msgpack over a real ZeroMQ socket, flushed after each
step, read by a thread here), `collect` keeps them in Python lists. `--audit-hook` installs a Python
audit hook like filelock's on Python >= 3.12 (the GPU image): every audited call (`id()` among them)
then runs Python code.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitserve.engine.checkpoints.model_shapes import write_shape_folder
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("host_step")


class PhaseTimer:
    """Wraps an engine's schedule, launch and complete (and what is device work inside them) to time
    each loop turn, in the loop thread's CPU time and in wall time."""

    def __init__(self, engine: Engine) -> None:
        self.turns: list[dict] = []
        self._turn: dict | None = None
        self._device = [0.0, 0.0]
        runner, scheduler = engine.runner, engine.scheduler
        schedule, launch, complete = scheduler.schedule, runner.launch, engine._complete

        def clocks() -> tuple[float, float]:
            return time.thread_time(), time.perf_counter()

        def add(key: str, t0: tuple[float, float]) -> None:
            """Adds the time since `t0`, less the device's share, to this turn's `key`."""
            cpu, wall = clocks()
            self._turn[key] += cpu - t0[0] - self._device[0]
            self._turn["wall_" + key] += wall - t0[1] - self._device[1]
            self._turn["device"] += self._device[0]
            self._turn["wall_device"] += self._device[1]
            self._device = [0.0, 0.0]

        def timed_schedule():
            t0 = clocks()
            if self._turn is not None:
                self._turn["turn"], self._turn["wall_turn"] = t0[0] - self._turn["t0"][0], t0[1] - self._turn["t0"][1]
                self.turns.append(self._turn)
            plan = schedule()
            self._turn = {"t0": t0, "rows": len(plan.chunks),
                          "decode": bool(plan.chunks) and all(c.length == 1 for c in plan.chunks),
                          **{k: 0.0 for name in ("schedule", "launch", "complete", "device")
                             for k in (name, "wall_" + name)}}
            add("schedule", t0)
            return plan

        def timed_device(fn):
            def run(*args, **kwargs):
                t0 = clocks()
                try:
                    return fn(*args, **kwargs)
                finally:
                    t1 = clocks()
                    self._device[0] += t1[0] - t0[0]
                    self._device[1] += t1[1] - t0[1]
            return run

        def timed_launch(chunks, page_table):
            t0 = clocks()
            pending = launch(chunks, page_table)
            add("launch", t0)
            pending.result = timed_device(pending.result)  # the wait for the step's tokens
            return pending

        def timed_complete(step):
            t0 = clocks()
            complete(step)
            add("complete", t0)

        scheduler.schedule = timed_schedule
        runner.launch = timed_launch
        engine._complete = timed_complete
        if runner.device.type == "cpu":  # the model's work runs on the host here: out of the host's share
            runner.forward = timed_device(runner.forward)
            runner.sample = timed_device(runner.sample)

    def take(self, rows: int) -> dict:
        """Medians over the turns since the last call that decode `rows` requests at once (per step,
        ms; per row, us); `host`: the whole turn less the device's share."""
        turns, self.turns = self.turns, []
        full = [t for t in turns if t["decode"] and t["rows"] == rows]
        if not full:
            return {"steps": 0}
        out: dict = {"steps": len(full)}
        for t in full:
            for clock in ("", "wall_"):
                t[clock + "rest"] = (t[clock + "turn"] - t[clock + "schedule"] - t[clock + "launch"]
                                     - t[clock + "complete"] - t[clock + "device"])
                t[clock + "host"] = t[clock + "turn"] - t[clock + "device"]
        for clock in ("", "wall_"):
            for name in ("schedule", "launch", "complete", "rest", "host", "device"):
                med = statistics.median(t[clock + name] for t in full)
                out[f"{clock}{name}_ms"] = med * 1e3
                out[f"{clock}{name}_us_per_row"] = med * 1e6 / rows
        return out


def audit_hook(event: str, _args: object, _watched: frozenset[str] = frozenset({"os.fork", "os.forkpty"})) -> None:
    """Does what filelock's fork-safety hook does for events it does not watch: a membership test."""
    if event in _watched:
        return


def shape_folder(shape: str, vocab: int | None) -> Path:
    folder = write_shape_folder(shape, Path(tempfile.mkdtemp(prefix=f"splitserve-host-step-{shape}-")))
    if vocab is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["vocab_size"] = vocab
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def core_sink(engine: Engine):
    """Sends every output as the engine core process does (OutputSink over ZeroMQ, flushed after each
    step; requests without stop strings get no text there) to a PULL socket that a thread here reads
    as the API server's reader thread does (unpacks, makes those requests' text); returns (observe,
    close, reader CPU seconds)."""
    import zmq

    from splitserve.api.core_protocol import InboxFigures, unpack
    from splitserve.api.engine_core import OutputSink
    try:
        from splitserve.api.detokenizer import TextElsewhere
        from splitserve.api.server_detokenizer import ServerDetokenizers, detokenized_by_server
    except ImportError:  # code from before the API server made text: the core detokenizes every request
        TextElsewhere = ServerDetokenizers = None

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    sink = OutputSink(push)
    figures = InboxFigures(0, 0, 0)
    engine.after_step = lambda: sink.flush(figures)
    detokenizers = ServerDetokenizers(engine.tokenizer) if ServerDetokenizers is not None else None
    keys: dict[str, int] = {}
    admit = engine._admit

    def admit_as_the_core(req) -> None:
        keys.setdefault(req.request_id, len(keys))
        if detokenizers is not None and detokenized_by_server(req.params):
            req.detokenizer = TextElsewhere()
            detokenizers.open(keys[req.request_id])
        admit(req)

    engine._admit = admit_as_the_core
    stop = threading.Event()
    reader_cpu = [0.0]

    def read() -> None:
        while not stop.is_set():
            if pull.poll(50):
                t = time.thread_time()
                message = unpack(pull.recv())
                if detokenizers is not None:
                    detokenizers.fill(message[1])
                reader_cpu[0] += time.thread_time() - t

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def close() -> None:
        stop.set()
        reader.join()
        context.destroy(linger=0)
        del engine._admit

    return (lambda out: sink.put(keys.get(out.request_id, -1), out)), close, reader_cpu


def burst(engine: Engine, timer: PhaseTimer, args: argparse.Namespace, sink: str, prompts: list[list[int]]) -> dict:
    """One burst of `prompts` with outputs going to `sink`: throughput, process CPU per output
    token, and the decode steps' phases."""
    observe, close, reader_cpu = core_sink(engine) if sink == "core" else (None, None, [0.0])
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        engine.call_soon(profiler.enable)  # cProfile sees only the thread that enables it
    timer.take(0)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    try:
        generate_tokens(engine, prompts, params, timeout=3600, observe=observe)
    finally:
        if close is not None:
            engine.after_step = None
            close()
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if profiler is not None:
        disabled = threading.Event()
        engine.call_soon(lambda: (profiler.disable(), disabled.set()))
        disabled.wait(30)
        profiler.dump_stats(f"{args.profile}.{sink}")
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    tokens = len(prompts) * args.output_len
    return {"sink": sink, "wall_s": wall, "output_tok_s": tokens / wall,
            "process_cpu_us_per_token": cpu_s * 1e6 / tokens, "reader_cpu_us_per_token": reader_cpu[0] * 1e6 / tokens,
            "decode_steps": timer.take(len(prompts))}


def run(args: argparse.Namespace) -> dict:
    folder = shape_folder(args.shape, args.vocab)
    engine = Engine(EngineConfig(model=str(folder), device=args.device, load_format="dummy",
                                 max_running_requests=args.requests, disable_prefix_cache=True,
                                 chunked_prefill_size=args.chunk, cuda_graph_max_batch=args.requests))
    engine.start()
    try:
        rng = random.Random(0)
        vocab = min(256, engine.model_cfg.vocab_size)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        generate_tokens(engine, prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm
        timer = PhaseTimer(engine)
        bursts = [burst(engine, timer, args, sink, prompts) for sink in args.sink]
        return {"shape": args.shape, "vocab": engine.model_cfg.vocab_size, "device": str(engine.runner.device),
                "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                "audit_hook": args.audit_hook, "overlap": engine.overlap, "bursts": bursts}
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--sink", nargs="+", choices=("collect", "core"), default=["collect"],
                        help="one burst per sink, in order, on one engine")
    parser.add_argument("--audit-hook", action="store_true", help="install a Python audit hook (as filelock does)")
    parser.add_argument("--profile", default=None, help="write a cProfile of the loop thread here")
    parser.add_argument("--output", default=None, help="write the JSON report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.audit_hook:
        sys.addaudithook(audit_hook)
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
