"""Where a loaded HTTP server spends its time: the serving profile's fixed load against a real shape,
with py-spy sampling the server process (every thread, and separately only the thread holding the GIL).

  python -P benchmarks/profile_http.py OUT_DIR [--shape llama-3.1-8b] [--load 256x512:256]
      [--variants main=/path/to/main:5 branch=.:1:/extra/site] [--profile-index 1] [--py-spy PATH]

Each variant is LABEL=PACKAGE_ROOT:SWITCH_MS[:EXTRA_PATH]: a server of the splitserve code in
PACKAGE_ROOT (so main's code and a branch's can be compared in one run), with
``--gil-switch-interval-ms SWITCH_MS`` where that code has the flag (a root without it runs Python's
default, 5), and EXTRA_PATH on its PYTHONPATH (packages only that variant depends on). Each server
takes a short warm-up load, then the load; the ``--profile-index`` variant's server then takes it
once more under
``py-spy record --threads --gil`` (samples of the thread holding the GIL). Output tok/s, TTFT and
ITL go to ``OUT_DIR/profile_http.json``, the samples to ``OUT_DIR/pyspy_gil.txt`` (collapsed stacks,
one line per stack: ``frames count``). A benchmark for the device, not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from splitserve.bench.load_client import client_line, default_client_processes

logger = logging.getLogger("profile_http")


def start_server(folder: Path, root: Path, switch_ms: float, extra_path: str, max_running: int,
                 log: Path) -> tuple[subprocess.Popen, str]:
    from splitserve.launcher.up import free_port, wait_healthy

    port = free_port()
    link = Path(tempfile.mkdtemp(prefix="splitserve-variant-"))
    (link / "splitserve").symlink_to(root.resolve())
    cmd = [sys.executable, "-P", "-m", "splitserve", "serve", "--model", str(folder), "--load-format", "dummy",
           "--device", "cuda", "--port", str(port), "--max-running-requests", str(max_running),
           "--disable-prefix-cache"]
    if "gil_switch_interval_ms" in (root / "engine" / "config.py").read_text():
        cmd += ["--gil-switch-interval-ms", str(switch_ms)]
    rest = os.environ.get("PYTHONPATH", "").split(os.pathsep)[1:]  # the first entry holds the default package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(link), *([extra_path] if extra_path else []), *rest])}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy([(url, proc)], timeout=600)
    return proc, url


def run_load(url: str, spec: str, seed: int, client_processes: int) -> dict:
    from splitserve.bench.serving import fixed_load
    from splitserve.bench.serving import run_load as serving_load

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return serving_load(url, model, fixed_load(spec), seed, client_processes)


def sampled(py_spy: str, pid: int, out: Path, gil: bool, url: str, spec: str, seed: int, client_processes: int) -> dict:
    cmd = [py_spy, "record", "--pid", str(pid), "--threads", "--rate", "200", "--format", "raw", "--output", str(out),
           "--nonblocking"]
    if gil:
        cmd.append("--gil")
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    result = run_load(url, spec, seed, client_processes)
    spy.send_signal(2)  # SIGINT: py-spy writes what it has
    try:
        _, err = spy.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        _, err = spy.communicate()
    result["py_spy_rc"] = spy.returncode
    result["py_spy_stderr"] = err.decode(errors="replace")[-500:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--load", default="256x512:256")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=["this=.:5"])
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile-index", type=int, default=0, help="which variant's server py-spy samples")
    parser.add_argument("--client-processes", type=int, default=default_client_processes(),
                        help="client worker processes the load is spread over (default min(8, CPUs))")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder

    args.out.mkdir(parents=True, exist_ok=True)
    folder = write_shape_folder(args.shape, Path(tempfile.mkdtemp(prefix="splitserve-profile-")))
    report: dict = {"shape": args.shape, "load": args.load, "runs": []}
    for i, variant in enumerate(args.variants):
        label, spec = variant.split("=", 1)
        root, switch_ms, extra_path = [*spec.split(":"), ""][:3]
        proc, url = start_server(folder, Path(root), float(switch_ms), extra_path, args.max_running_requests,
                                 args.out / f"server_{i}.log")
        try:
            run_load(url, "32x512:32", 1, args.client_processes)  # warm-up
            plain = run_load(url, args.load, 2, args.client_processes)
            entry = {"variant": label, "root": root, "switch_ms": float(switch_ms), "plain": plain}
            logger.info("%s: %.0f output tok/s, TTFT p50 %.2f s, ITL p50 %.1f ms", variant, plain["output_tok_s"],
                        plain["ttft_s"]["p50"], plain["itl_s"]["p50"] * 1e3)
            report["runs"].append(entry)
            (args.out / "profile_http.json").write_text(json.dumps(report, indent=2))
            if args.profile and i == args.profile_index:
                entry["gil"] = sampled(args.py_spy, proc.pid, args.out / "pyspy_gil.txt", True, url, args.load, 4,
                                      args.client_processes)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        (args.out / "profile_http.json").write_text(json.dumps(report, indent=2))
    for entry in report["runs"]:
        p = entry["plain"]
        print(f"{entry['variant']} (switch {entry['switch_ms']:g} ms): {p['output_tok_s']:.0f} output tok/s, "
              f"TTFT p50 {p['ttft_s']['p50']:.2f} s, ITL p50 {p['itl_s']['p50'] * 1e3:.1f} ms "
              f"({p['ok']}/{p['requests']})")
        print(f"  {client_line(p['client'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
