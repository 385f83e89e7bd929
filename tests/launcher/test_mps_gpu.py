"""`up --mps` on a GPU: the daemon starts, engines that share the GPU attach to its one server, a split
deployment through it answers as the unified engine does, and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch
from servers import children_of, cmdline_of, running_up

from splitserve.launcher.mps import CONTROL_BINARY, plan_mps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(CONTROL_BINARY) is None,
                                reason=f"needs a CUDA device and {CONTROL_BINARY}")

HOLD = "import sys, torch; torch.ones(1, device='cuda:0'); torch.cuda.synchronize(); print('up', flush=True); " \
       "sys.stdin.readline()"


def test_two_clients_attach_to_the_daemons_one_server_and_quit_leaves_nothing(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    daemon = plan_mps("on", ["cuda:0"])
    assert daemon is not None
    proc = subprocess.Popen(daemon.command, env={**os.environ, **daemon.env}, start_new_session=True)
    clients = []
    try:
        assert daemon.wait_ready(proc) == "" and daemon.probe() == ""
        for _ in range(2):
            clients.append(subprocess.Popen([sys.executable, "-P", "-c", HOLD], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, env={**os.environ, **daemon.env}))
        for c in clients:
            assert c.stdout.readline().strip() == "up"
        assert len(daemon.server_pids()) == 1
        assert {c.pid for c in clients} <= set(daemon.client_pids())
    finally:
        for c in clients:
            c.communicate("\n", timeout=30)
        daemon.quit(proc)
    assert proc.returncode is not None and not daemon.directory.exists()


@pytest.mark.parametrize("transfer", [[], ["--engine-args", "--transfer-protocol cuda_ipc"]],
                         ids=["mooncake", "cuda_ipc"])
def test_a_split_deployment_through_mps_answers_as_the_unified_engine(tmp_path, transfer):
    body = {"model": "tiny", "prompt": "Hello there, how are", "max_tokens": 16, "temperature": 0}
    with running_up(["--model", "tiny", "--device", "cuda:0", "--unified", "1", "--mps", "off"],
                    tmp_path / "unified.log") as up:
        want = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    with running_up(["--model", "tiny", "--device", "cuda:0", "--prefill", "1", "--decode", "1", "--mps", "on",
                     *transfer], tmp_path / "split.log") as up:
        engines = [pid for pids in up.engines().values() for pid, _ in pids]
        assert len(engines) == 2 and all("CUDA_MPS_PIPE_DIRECTORY" in _environ(pid) for pid in engines)
        router = [pid for pid in children_of(up.proc.pid) if "router" in cmdline_of(pid)]
        assert len(router) == 1 and "CUDA_MPS_PIPE_DIRECTORY" not in _environ(router[0])
        assert any(CONTROL_BINARY in " ".join(cmdline_of(pid)) for pid in children_of(up.proc.pid))
        pipe = _environ(engines[0])["CUDA_MPS_PIPE_DIRECTORY"]
        got = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert got == want
        up.sigterm_leaves_no_child()
    deadline = time.monotonic() + 30
    while os.path.exists(pipe):
        assert time.monotonic() < deadline, f"the daemon's pipe directory {pipe} outlived `up`"
        time.sleep(0.2)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
