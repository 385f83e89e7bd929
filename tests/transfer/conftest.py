"""Fixtures for the transfer layer: real Mooncake TCP on loopback, real sockets, real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import pytest
import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import (
    BootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    aux_device,
    layout_for_pool,
    make_aux_tensor,
    new_kv_manager,
)

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "transfer_peer.py"
_spec = importlib.util.spec_from_file_location("splitserve_tests_transfer_peer", PEER_SCRIPT)
assert _spec and _spec.loader
peer_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_helpers)
fill_pool = peer_helpers.fill_pool

HEARTBEAT_S = 0.1
HEARTBEAT_MISSES = 5
FAST = TransferConfig(
    transfer_heartbeat_interval_s=HEARTBEAT_S, transfer_heartbeat_misses=HEARTBEAT_MISSES,
    transfer_bootstrap_timeout_s=10.0, transfer_waiting_timeout_s=10.0, transfer_timeout_s=10.0,
)
SHAPE = dict(layers=2, pages=128, page_size=4, heads=2, head_dim=16)
FINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass
class Rank:
    """One engine rank's transfer side: its manager, KV pool and aux tensor."""

    mgr: KVManager
    pool: torch.Tensor
    aux: torch.Tensor


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def poll_until_final(rooms: list, timeout_s: float = 10.0) -> list[list[KVPoll]]:
    """Polls like a scheduler loop until every room is final; returns each room's observed states."""
    observed: list[list[KVPoll]] = [[] for _ in rooms]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = True
        for seen, room in zip(observed, rooms, strict=True):
            state = room.poll()
            if not seen or seen[-1] != state:
                seen.append(state)
            done &= state in FINAL
        if done:
            return observed
        time.sleep(0.002)
    raise AssertionError(f"rooms not final after {timeout_s}s: {[s[-1] for s in observed]}")


@pytest.fixture(autouse=True)
def no_thread_leaks() -> Iterator[None]:
    """Every Python thread a test starts is gone when it ends."""
    before = set(threading.enumerate())
    yield
    assert wait_until(lambda: not (set(threading.enumerate()) - before), 5.0), \
        f"threads left: {[t.name for t in set(threading.enumerate()) - before]}"


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    server = BootstrapServer("127.0.0.1", 0).start()
    yield server
    server.stop()


@pytest.fixture
def make_rank() -> Iterator[Callable[..., Rank]]:
    """Builds ranks; at teardown checks no room is left registered, then closes them."""
    made: list[Rank] = []

    def make(seed: int | None = None, *, config: TransferConfig = FAST, tp_size: int = 1, tp_rank: int = 0,
             num_kv_heads: int | None = None, registry: CollectorRegistry | None = None,
             shape: dict | None = None, fill: float = 0.0, device: str = "cpu",
             dtype: torch.dtype = torch.float16) -> Rank:
        s = {**SHAPE, **(shape or {})}
        dims = (s["layers"], 2, s["pages"], s["page_size"], s["heads"], s["head_dim"])
        pool = fill_pool(dims, seed) if seed is not None else torch.full(dims, fill, dtype=torch.float16)
        pool = pool.to(device=device, dtype=dtype)
        aux = make_aux_tensor(32, device=aux_device(config, pool.device))
        layout = layout_for_pool(pool, aux, tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=num_kv_heads)
        rank = Rank(new_kv_manager(config, layout, metrics_registry=registry or CollectorRegistry()), pool, aux)
        made.append(rank)
        return rank

    yield make
    try:
        for rank in made:
            assert rank.mgr.stats()["rooms"] == 0, f"rooms left registered: {rank.mgr.stats()}"
    finally:
        for rank in made:
            rank.mgr.close()


def readable(stream, timeout_s: float) -> bool:
    """Whether `stream` has something to read (or hit its end) within `timeout_s`. poll, not select: select cannot
    watch a descriptor numbered 1024 or more, which a long test session's process reaches."""
    poller = select.poll()
    poller.register(stream, select.POLLIN | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout_s) * 1e3))


class PeerProcess:
    """``transfer_peer.py`` in a subprocess, driven by JSON lines."""

    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(PEER_SCRIPT), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "2"},
        )
        self._buf = b""
        self._next_id = 0
        self.ready = self._read_line(60.0)
        assert self.ready.get("ready"), self.ready

    def _read_line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("peer process did not answer")
            if readable(self.proc.stdout, left):
                data = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not data:
                    raise RuntimeError(f"peer process exited ({self.proc.poll()})")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def command(self, cmd: str, **fields: object) -> int:
        self._next_id += 1
        self.proc.stdin.write((json.dumps({"id": self._next_id, "cmd": cmd, **fields}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next_id

    def result(self, timeout_s: float = 30.0) -> dict:
        return self._read_line(timeout_s)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("exit")
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[[dict], PeerProcess]]:
    peers: list[PeerProcess] = []

    def spawn(cfg: dict) -> PeerProcess:
        full = {**SHAPE, "seed": 7, "transfer": {
            "transfer_heartbeat_interval_s": HEARTBEAT_S, "transfer_heartbeat_misses": HEARTBEAT_MISSES,
            "transfer_bootstrap_timeout_s": 10.0, "transfer_waiting_timeout_s": 10.0,
            "transfer_timeout_s": 10.0}, **cfg}
        peer = PeerProcess(full)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.close()


def transfer_once(prefill, decode_mgr, bootstrap_addr: str, room: int, src: list[int], dst: list[int],
                  aux_index: int = 0) -> None:
    """One whole room between an in-process prefill rank and an in-process decode manager; must succeed."""
    sender = KVSender(prefill.mgr, bootstrap_addr, room)
    receiver = KVReceiver(decode_mgr, bootstrap_addr, room)
    receiver.init()
    receiver.send_metadata(dst, aux_index)
    sender.init(len(src), aux_index)
    sender.send(src, last_chunk=True)
    poll_until_final([sender, receiver], timeout_s=10)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    sender.clear()
    receiver.clear()
