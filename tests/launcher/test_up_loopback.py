"""`splitserve up` on one machine: no engine port, Mooncake's included, listens beyond loopback."""

from __future__ import annotations

import os

import httpx
import pytest
import servers
from listening import is_loopback, listening
from servers import MOONCAKE_TCP_PORTS, children_of, running_up

pytestmark = pytest.mark.slow


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The tests' environment without their MC_TCP_BIND_ADDRESS: what a user's shell gives `up`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPLITSERVE_", "MC_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra or {})})
    return env


def test_up_listens_on_loopback_only_mooncake_ports_included(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(servers, "splitserve_env", user_env)
    with running_up(["--model", "tiny", "--prefill", "1", "--decode", "1"], tmp_path / "up.log") as up:
        # A request first: the prefill opens a Mooncake engine of its own per decode peer when it first writes.
        r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        engines = {role: pid for role, started in up.engines().items() for pid, _ in started}
        assert sorted(engines) == ["decode", "prefill"]
        sockets = {pid: listening(pid) for pid in children_of(up.proc.pid)}
        assert len(sockets) == 3  # the two engines and the router
        report = "\n".join(f"{pid}: {', '.join(f'{a}:{p}' for a, p in found)}" for pid, found in sockets.items())
        wide = [(pid, str(a), p) for pid, found in sockets.items() for a, p in found if not is_loopback(a)]
        assert not wide, f"listening beyond loopback: {wide}\n{report}"
        # Not vacuous: Mooncake's RPC handshake and TCP data ports (its 15000-17000 range) were found,
        # two per engine, and the prefill's second engine (the one it writes through) too.
        mooncake = {role: [p for _, p in sockets[pid] if p in MOONCAKE_TCP_PORTS] for role, pid in engines.items()}
        assert len(mooncake["decode"]) >= 2 and len(mooncake["prefill"]) >= 4, f"{mooncake}\n{report}"
        up.sigterm_leaves_no_child()
