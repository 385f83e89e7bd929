"""Fixtures shared by every test folder (helpers live in tests/servers.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# With --import-mode=importlib no test folder is on sys.path; this one holds helper modules.
sys.path.insert(0, str(Path(__file__).parent))

from servers import ServerProcess, wait_http_ok


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(args, health_url=..., env=...) starts a splitserve process and waits for it."""
    started: list[ServerProcess] = []

    def start(args: list[str], health_url: str | None = None, env: dict[str, str] | None = None,
              timeout: float = 120.0) -> ServerProcess:
        log = tmp_path / f"server-{len(started)}.log"
        server = ServerProcess(args, log, env)
        started.append(server)
        if health_url is not None:
            wait_http_ok(health_url, server.proc, timeout, log)
        return server

    yield start
    for s in started:
        s.stop()


