"""Helpers for tests that run real servers: free ports, splitserve processes, leak checks."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from splitserve.transfer.bootstrap_grant import KEY_HEADER, sign_bootstrap

REPO = Path(__file__).resolve().parents[1]
# The group key tests give prefill/decode engines and routers (splitserve up and the operator always
# give one): it signs bootstrap grants and control messages, and opens /internal/*.
TEST_CONTROL_KEY = "splitserve-test-group-key"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Mooncake's TCP transport listens on random ports of this range (on 0.0.0.0), one per transfer
# engine, and a prefill runs several: a port handed out here could be taken by one starting up.
MOONCAKE_TCP_PORTS = range(15000, 17001)  # Mooncake draws from 15000-17000, both ends included


# Every port handed out by this process: a port is free until its server binds it, so without this two
# servers started together (an engine's HTTP port, another's bootstrap port) could be given the same one.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range and outside Mooncake's, never handed out before by
    this process. A port from bind(0) is an ephemeral one, and between this call and the server's bind an
    engine starting up (gloo, ZeroMQ, its own outgoing connections) may be handed the very same port by the
    kernel, as Mooncake may pick one of its range: 'address already in use'."""
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        if port in MOONCAKE_TCP_PORTS or port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port in [10000, {low}) after 200 tries")


def wait_http_ok(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    """Polls `url` until it answers 200; fails at once if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"process for {url} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def wait_router_took_in(router: str, engines: set[str], deadline: float) -> None:
    """Waits until `router` routes to each of `engines` it has. A router is ready with one engine of a role and
    takes a later one in only at its next probe (after a backoff of up to --eject-backoff-max-s), which a test
    that counts on every engine must wait for."""
    while True:
        backends = httpx.get(f"{router}/health", timeout=5).json()["backends"]
        # Routable as the router's Backend.routable says: healthy, and neither draining nor suspect.
        waiting = [b["url"] for b in backends if b["url"] in engines and not (
            b["healthy"] and not (b["draining"] or b["engine_draining"] or b["suspect"]))]
        if not waiting:
            return
        assert time.monotonic() < deadline, f"router {router} has not taken in {waiting}: {backends}"
        time.sleep(0.1)


def splitserve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    env.update({"PYTHONUNBUFFERED": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1", "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


class ServerProcess:
    """A `splitserve ...` subprocess with its log; stopped (and reaped) by the fixture."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve", *args], stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=splitserve_env(env), cwd=REPO.parent)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def served(serve_args: list[str], log: Path, timeout: float = 120.0) -> Iterator[str]:
    """`splitserve serve *serve_args` on a free port: yields its base URL once `/health` answers, and
    stops the process on exit (for the many module fixtures that serve one engine)."""
    port = free_port()
    proc = ServerProcess(["serve", *serve_args, "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc.proc, timeout, proc.log)
        yield url
    finally:
        proc.stop()


def bootstrap_grant(host: str, port: int, room: int, key: str = TEST_CONTROL_KEY) -> dict:
    """The bootstrap fields of a request as the router sends them: signed with the group's key."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room,
            "bootstrap_signature": sign_bootstrap(key, host, port, room)}


def engine_state(base_url: str, key: str = TEST_CONTROL_KEY) -> dict:
    r = httpx.get(f"{base_url}/internal/state", headers={KEY_HEADER: key} if key else {}, timeout=5)
    r.raise_for_status()
    return r.json()


def assert_kv_back_to_start(base_url: str, timeout: float = 10.0, key: str = TEST_CONTROL_KEY) -> dict:
    """Waits until no request holds anything: no running/waiting/parked, every page free or cached."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_state(base_url, key)
        idle = (s["running"] == 0 and s["waiting"] == 0 and s["parked"] == 0 and s["requests"] == 0
                and s["kv_locked"] == 0 and s["kv_used_by_requests"] == 0 and s["slots_in_use"] == 0)
        if idle and s["kv_free"] + s["kv_cached"] == s["kv_capacity"]:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"KV resources not back to start at {base_url}: {s}")
        time.sleep(0.05)


class LocalDeployment:
    """Engines and routers of one test as `splitserve` processes, by URL, stopped together."""

    def __init__(self, tmp: Path, checkpoint: Path, engine_args: list[str], transfer_args: list[str]) -> None:
        self.tmp = tmp
        self.checkpoint = checkpoint
        self.engine_args = engine_args
        self.transfer_args = transfer_args
        self.procs: dict[str, ServerProcess] = {}
        self.ready_paths: dict[str, str] = {}  # where each process says it is ready (/health unless set)

    def engine(self, role: str, *extra: str) -> str:
        """Starts `splitserve serve --role <role>` (later flags win over earlier ones); returns its URL."""
        port = free_port()
        args = ["serve", "--role", role, "--model", str(self.checkpoint), "--served-model-name", "m",
                "--port", str(port), *self.engine_args]
        if role in ("prefill", "decode"):
            args += ["--transfer-control-key", TEST_CONTROL_KEY, *self.transfer_args]
        if role == "prefill":
            args += ["--bootstrap-port", str(free_port()), "--chunked-prefill-size", "8"]
        url = f"http://127.0.0.1:{port}"
        self.procs[url] = ServerProcess([*args, *extra], self.tmp / f"{role}-{port}.log")
        return url

    def router(self, prefill: list[str], decode: list[str], *extra: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.procs[url] = ServerProcess(["router", "--port", str(port), "--transfer-control-key", TEST_CONTROL_KEY,
                                         "--prefill", *prefill, "--decode", *decode,
                                         *extra], self.tmp / f"router-{port}.log")
        self.ready_paths[url] = "/ready"  # /health is its liveness
        return url

    def wait(self, urls: list[str], timeout: float = 180.0) -> None:
        for url in urls:
            path = self.ready_paths.get(url, "/health")
            wait_http_ok(f"{url}{path}", self.procs[url].proc, timeout, self.procs[url].log)

    def restart(self, url: str) -> None:
        """Starts a process again with the same flags (so the same ports), after it died."""
        old = self.procs[url]
        old.stop()
        self.procs[url] = ServerProcess(old.args, old.log.with_suffix(".restarted.log"))

    def alive(self, url: str) -> bool:
        return self.procs[url].proc.poll() is None

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


def children_of(pid: int) -> list[int]:
    """Direct children of a process, from /proc (the engines and the router `up` started)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def cmdline_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def stop_up(proc: subprocess.Popen) -> None:
    """Stops a `splitserve up` (SIGTERM: it stops its children); if it will not, kills it and them,
    so that a failing test leaves no engine behind (they run in sessions of their own)."""
    if proc.poll() is not None:
        return
    kids = children_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        for pid in {*kids, *children_of(proc.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


class UpProcess:
    """A `splitserve up *args` on a free port, its stderr in `log_path`; ready once it printed its endpoint."""

    def __init__(self, args: list[str], log_path: Path, command: list[str] | None = None,
                 cwd: Path | None = None) -> None:
        """`command` runs splitserve (default: this interpreter's `-P -m splitserve`), from `cwd`."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        command = command or [sys.executable, "-P", "-m", "splitserve"]
        self.proc = subprocess.Popen([*command, "up", "--port", str(self.port), "--device", "cpu", *args],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=splitserve_env(),
                                     cwd=cwd or REPO.parent)
        line = self.proc.stdout.readline()  # the one line `up` prints once everything is ready
        if line.strip() != f"endpoint: {self.url}/v1":
            self.close()
            raise AssertionError(f"`up` printed {line!r}; its log ends:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text()

    def engines(self) -> dict[str, list[tuple[int, str]]]:
        """role -> [(pid, url)] of the engines `up` runs now."""
        engines: dict[str, list[tuple[int, str]]] = {}
        for pid in children_of(self.proc.pid):
            args = cmdline_of(pid)
            if "serve" in args:
                url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
                engines.setdefault(args[args.index("--role") + 1], []).append((pid, url))
        return engines

    def sigterm_leaves_no_child(self, timeout: float = 10.0) -> None:
        """SIGTERM stops `up` with status 0, and every child it had goes with it."""
        children = children_of(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=40) == 0
        deadline = time.monotonic() + timeout
        while any(os.path.exists(f"/proc/{c}") and not is_zombie(c) for c in children):
            assert time.monotonic() < deadline, "a child of `up` outlived it"
            time.sleep(0.1)

    def close(self) -> None:
        stop_up(self.proc)
        self._log.close()


@contextlib.contextmanager
def running_up(args: list[str], log_path: Path, command: list[str] | None = None,
               cwd: Path | None = None) -> Iterator[UpProcess]:
    up = UpProcess(args, log_path, command, cwd)
    try:
        yield up
    finally:
        up.close()


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
