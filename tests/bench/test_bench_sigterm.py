"""A bench stopped with SIGTERM (a `timeout`, a job runner) stops the deployment it started: its engines run in
sessions of their own, so a bench killed outright would leave them holding their ports and GPU memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from servers import REPO, children_of, is_zombie, splitserve_env

pytestmark = pytest.mark.slow


def test_sigterm_stops_the_deployment_a_bench_started(tmp_path) -> None:
    log = (tmp_path / "bench.log").open("w")
    bench = subprocess.Popen([sys.executable, "-P", "-m", "splitserve", "bench", "--profile", "phases", "--model",
                              "tiny", "--device", "cpu", "--rates", "1", "--num-requests", "400", "--burst", ""],
                             stdout=log, stderr=subprocess.STDOUT, env=splitserve_env(), cwd=REPO.parent)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(children := children_of(bench.pid)) < 2:  # the unified engine and its router, under load
            assert bench.poll() is None and time.monotonic() < deadline, (tmp_path / "bench.log").read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2)
        children = children_of(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{c}") and not is_zombie(c) for c in children):
            assert time.monotonic() < deadline, "a process the bench started outlived it"
            time.sleep(0.2)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in children:  # what a failing run left (reparented away from the bench by now)
            if os.path.exists(f"/proc/{pid}") and not is_zombie(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
