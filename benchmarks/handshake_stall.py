"""How long a room to a healthy decode waits while the prefill's first handshake with a fresh,
frozen decode peer hangs: one shared Mooncake engine vs one writer engine per peer, same run.

Mooncake 0.3.13 runs a first handshake under its engine's mutex (every write of the engine takes
it too) and its socket read gives up after 60 s; transfer/mooncake/peer_engines.py gives each peer its own
engine. Real processes on loopback: the prefill and the healthy decode in this process, the
fresh peer in a subprocess (it sends its metadata, is SIGSTOPped, then the prefill takes the
metadata in and starts the handshake). Prints seconds per setting and their ratio.

    PYTHONPATH=... python -P benchmarks/handshake_stall.py [--writer-engines 8]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import (
    BootstrapServer,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    layout_for_pool,
    make_aux_tensor,
)

log = logging.getLogger("handshake_stall")
POOL = (2, 2, 64, 4, 2, 16)  # layers, k/v, pages, page size, heads, head dim
CONFIG = TransferConfig(transfer_heartbeat_interval_s=1.0, transfer_heartbeat_misses=120,
                        transfer_bootstrap_timeout_s=200, transfer_waiting_timeout_s=200, transfer_timeout_s=200)
FRESH_PEER = textwrap.dedent("""
    import json, sys, time, torch
    from splitserve.transfer import KVManager, KVReceiver, TransferConfig, layout_for_pool, make_aux_tensor
    cfg = json.loads(sys.argv[1])
    pool, aux = torch.zeros(cfg["pool"], dtype=torch.float16), make_aux_tensor(8)
    mgr = KVManager(TransferConfig(**cfg["config"]), layout_for_pool(pool, aux, tp_size=1, tp_rank=0))
    receiver = KVReceiver(mgr, cfg["bootstrap"], 3)
    receiver.init()
    receiver.send_metadata([1, 2], 3)
    print("sent", flush=True)
    time.sleep(3600)
""")


def manager(config: TransferConfig, seed: int | None = None) -> tuple[KVManager, torch.Tensor, torch.Tensor]:
    pool = torch.zeros(POOL, dtype=torch.float16) if seed is None else \
        torch.randint(-1000, 1000, POOL, generator=torch.Generator().manual_seed(seed)).to(torch.float16)
    aux = make_aux_tensor(8)
    return KVManager(config, layout_for_pool(pool, aux, tp_size=1, tp_rank=0),
                     metrics_registry=CollectorRegistry()), pool, aux


def room(prefill: KVManager, decode: KVManager, addr: str, room_id: int, timeout_s: float = 120) -> float:
    """One whole room; returns its seconds (must succeed)."""
    sender, receiver = KVSender(prefill, addr, room_id), KVReceiver(decode, addr, room_id)
    started = time.monotonic()
    receiver.init()
    receiver.send_metadata([5, 6], 1)
    sender.init(2, 1)
    sender.send([9, 10], last_chunk=True)
    while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) or sender.poll() not in (KVPoll.Success,
                                                                                           KVPoll.Failed):
        if time.monotonic() - started > timeout_s:
            raise RuntimeError("room not final")
        time.sleep(0.001)
    elapsed = time.monotonic() - started
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    sender.clear()
    receiver.clear()
    return elapsed


def stall_with(writer_engines: int) -> float:
    config = CONFIG.replace(transfer_writer_engines=writer_engines)
    server = BootstrapServer("127.0.0.1", 0).start()
    prefill_rank, healthy_rank = manager(config, seed=1), manager(config)  # pools stay alive until close()
    prefill, healthy = prefill_rank[0], healthy_rank[0]
    peer = None
    try:
        prefill.publish_layout(server.address)
        room(prefill, healthy, server.address, 1)  # the healthy peer's session is open
        peer = subprocess.Popen([sys.executable, "-P", "-c", FRESH_PEER, json.dumps(
            {"pool": POOL, "bootstrap": server.address, "config": {"transfer_heartbeat_misses": 120}})],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "GLOG_minloglevel": "2"})
        assert peer.stdout is not None and peer.stdout.readline().strip() == b"sent"
        deadline = time.monotonic() + 10
        while prefill.stats()["early_metadata"] < 1:
            assert time.monotonic() < deadline, "the fresh peer's metadata never arrived"
            time.sleep(0.005)
        peer.send_signal(signal.SIGSTOP)
        stuck = KVSender(prefill, server.address, 3)
        stuck.init(2, 3)  # takes the metadata in: the handshake with the frozen peer starts
        time.sleep(0.3)
        waited = room(prefill, healthy, server.address, 4)
        stuck.abort("benchmark over")
        stuck.clear()
        return waited
    finally:
        if peer is not None:
            peer.kill()
            peer.wait(10)
        prefill.close()
        healthy.close()
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writer-engines", type=int, default=TransferConfig().transfer_writer_engines)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shared = stall_with(0)
    own = stall_with(args.writer_engines)
    print(json.dumps({"healthy_room_s_one_shared_engine": round(shared, 3),
                      f"healthy_room_s_{args.writer_engines}_writer_engines": round(own, 4),
                      "ratio_shared_to_per_peer": round(shared / own, 1)}))


if __name__ == "__main__":
    main()
