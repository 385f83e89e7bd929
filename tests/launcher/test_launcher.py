"""`splitserve up`: the README's main command starts a whole deployment and stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from servers import REPO, children_of, running_up, splitserve_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shape", [["--prefill", "1", "--decode", "1"], ["--unified", "2"]])
def test_up_serves_then_stops_every_process_on_sigterm(shape: list[str], tmp_path) -> None:
    with running_up(["--model", "tiny", *shape], tmp_path / "up.log") as up:
        children = children_of(up.proc.pid)
        assert len(children) == 3  # two engines and the router
        keys = [environ_of(c) for c in children]  # one group key for all, engines and router alike
        assert len({k["SPLITSERVE_TRANSFER_CONTROL_KEY"] for k in keys}) == 1
        assert len(keys[0]["SPLITSERVE_TRANSFER_CONTROL_KEY"]) == 64
        assert all(k["SPLITSERVE_ROUTER_TRANSFER_CONTROL_KEY"] == k["SPLITSERVE_TRANSFER_CONTROL_KEY"] for k in keys)
        r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        up.sigterm_leaves_no_child()


def test_up_says_it_is_up_naming_every_role_it_started(tmp_path) -> None:
    """The "is up" line counts and locates every engine, encoders and drafters too, not just prefill/decode."""
    with running_up(["--model", "tiny-llava", "--encode", "1", "--drafter", "1"], tmp_path / "up.log") as up:
        (line,) = [x for x in up.log_text().splitlines() if "splitserve is up" in x]
        assert "(1 prefill + 1 decode + 1 encode + 1 drafter, model tiny-llava)" in line, line
        engines = up.engines()
        assert sorted(engines) == ["decode", "drafter", "encode", "prefill"], engines
        for role, started in engines.items():
            ((_, url),) = started
            assert f"{role}: {url}" in line, line
        assert f"{up.url}/v1" in line
        up.sigterm_leaves_no_child()


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)


def test_up_restarts_a_killed_engine_and_the_router_serves_throughout(tmp_path) -> None:
    with running_up(["--model", "tiny", "--prefill", "1", "--decode", "2", "--restart-backoff-s", "0.5"],
                    tmp_path / "up.log") as up:
        victim, victim_url = up.engines()["decode"][0]
        os.kill(victim, signal.SIGKILL)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + 90
        served = 0
        while True:  # the router serves on the other decode while the victim restarts
            r = httpx.post(f"{up.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            served += 1
            state = {b["url"]: b for b in httpx.get(f"{up.url}/health", timeout=5).json()["backends"]}
            if state[victim_url]["healthy"] and state[victim_url]["ejections"] >= 1:
                break  # back, and the router took it back in
            assert time.monotonic() < deadline, f"{victim_url} never came back: {state[victim_url]}"
            time.sleep(0.2)
        assert served >= 2
        assert "restart 1 in" in up.log_text() and "restarting decode-" in up.log_text()
        children = children_of(up.proc.pid)
        assert victim not in children and len(children) == 4  # the new decode replaced the killed one
        up.sigterm_leaves_no_child()


def test_up_names_a_missing_model_before_starting_anything(tmp_path) -> None:
    missing = str(tmp_path / "no-such-model")
    r = subprocess.run([sys.executable, "-P", "-m", "splitserve", "up", "--model", missing],
                       capture_output=True, text=True, env=splitserve_env(), cwd=REPO.parent, timeout=60)
    assert r.returncode == 2
    assert f"--model {missing!r} is neither a folder nor a .gguf file" in r.stderr
    assert "starting" not in r.stderr  # no engine was started


def test_up_and_serve_default_to_smollm2() -> None:
    from splitserve.engine.config import EngineConfig
    from splitserve.launcher.up import UpConfig

    assert UpConfig().model == EngineConfig().model == "smollm2"


def test_up_refuses_a_shape_with_no_decode() -> None:
    r = subprocess.run([sys.executable, "-P", "-m", "splitserve", "up", "--prefill", "1", "--decode", "0"],
                       capture_output=True, text=True, env=splitserve_env(), cwd=REPO.parent, timeout=60)
    assert r.returncode == 2
    assert "need at least one prefill and one decode engine, got 1P0D" in r.stderr


def test_up_restarts_an_engine_whose_core_died_while_its_api_server_stayed_up(tmp_path) -> None:
    """A GPU fault under MPS (or any death of an engine core) leaves the engine's API server up, answering 503 on
    /health: `up`'s liveness checks stop it after --liveness-failures and it is restarted and serves again."""
    with running_up(["--model", "tiny", "--unified", "1", "--engine-args=--engine-process",
                     "--liveness-period-s", "0.5", "--liveness-failures", "2", "--restart-backoff-s", "0.5"],
                    tmp_path / "up.log") as up:
        api_pid, _ = up.engines()["unified"][0]
        (core,) = children_of(api_pid)
        os.kill(core, signal.SIGKILL)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + 90
        while True:
            r = httpx.post(f"{up.url}/v1/completions", json=body, timeout=30)
            if r.status_code == 200 and up.engines()["unified"][0][0] != api_pid:
                break  # a new engine serves
            assert time.monotonic() < deadline, f"the engine was not restarted: {r.status_code} {r.text[:300]}"
            time.sleep(0.2)
        log = up.log_text()
        assert "failed liveness check 2 of 2" in log and "stopping it for a restart" in log, log[-2000:]
        assert "restarting unified-0" in log
        assert api_pid not in children_of(up.proc.pid)
        up.sigterm_leaves_no_child()
