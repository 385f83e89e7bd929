"""Transfer throughput: the transfer layer side by side with raw Mooncake, memcpy and a TCP socket.

For each message size (4 KiB .. 256 MiB) and for real KV page layouts, one run measures:

- ``memcpy``: one contiguous ``memcpy`` (ctypes.memmove) of the same number of bytes;
- ``socket``: a plain loopback TCP socket (``sendall`` / ``recv_into``) of the same bytes;
- ``mooncake``: raw ``batch_transfer_sync_write`` of the same segments between two engines;
- ``layer``: a full room through ``splitserve.transfer`` (sender ``send`` to receiver
  ``Success``: segment planning, worker thread, Mooncake, status message, poll), and
  ``room``: the same plus creating both sides and the metadata round trip.

Figures are GB/s (1e9 bytes/s) and ratios to each other from the same run. Two managers in
one process, TCP on 127.0.0.1 (``MC_TCP_BIND_ADDRESS``); run ``main(["--help"])`` for options.
``--transfer-protocol cuda_ipc`` runs bench/cuda_ipc.py instead (two processes on one GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

MIB = 1 << 20
DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]


@dataclass
class Row:
    """One line of the report: a workload and each method's throughput in GB/s."""

    name: str
    nbytes: int
    segments: int
    memcpy: float
    socket: float
    mooncake: float
    layer: float
    room: float


def _timed(fn: Callable[[], None], nbytes: int, min_time_s: float, max_iters: int) -> float:
    """Median GB/s of ``fn`` over repeats lasting at least ``min_time_s`` (after one warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time_s and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


class SocketPair:
    """A loopback TCP connection with a receiver thread that ``recv_into``s a destination buffer."""

    def __init__(self) -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        self.tx = socket.create_connection(listener.getsockname())
        self.rx, _ = listener.accept()
        listener.close()
        for s in (self.tx, self.rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._want = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._dst: memoryview | None = None
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            self._want.acquire()
            if self._dst is None:
                return
            view, got = self._dst, 0
            while got < len(view):
                n = self.rx.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            self.rx.sendall(b"k")  # acknowledge, as Mooncake's write does
            self._done.release()

    def send(self, src: memoryview, dst: memoryview) -> None:
        self._dst = dst
        self._want.release()
        self.tx.sendall(src)
        self.tx.recv(1)
        self._done.acquire()

    def close(self) -> None:
        self._dst = None
        self._want.release()
        self.tx.close()
        self.rx.close()
        self._thread.join(timeout=5)


def _byte_view(tensor) -> memoryview:
    import torch

    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def run(sizes: Sequence[int], kv_tokens: int, min_time_s: float, head_slice_tokens: int) -> list[Row]:
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
    from splitserve.transfer.kv.plan import page_segments

    config = TransferConfig(transfer_threads=2)
    registry = CollectorRegistry()
    sock = SocketPair()
    rows: list[Row] = []
    managers: list[KVManager] = []
    aux: list[torch.Tensor] = []
    room_ids = iter(range(1, 1 << 62))

    def pair(src_pool: torch.Tensor, dst_pool: torch.Tensor) -> tuple[KVManager, KVManager]:
        # The aux tensors must outlive the managers (Mooncake writes into them): keep them.
        aux.extend((make_aux_tensor(4), make_aux_tensor(4)))
        a = KVManager(config, layout_for_pool(src_pool, aux[-2]), metrics_registry=registry)
        b = KVManager(config, layout_for_pool(dst_pool, aux[-1]), metrics_registry=registry)
        managers.extend((a, b))
        return a, b

    def room_once(prefill: list[KVManager], decode: KVManager, addr: str, src_pages: list[int],
                  dst_pages: list[int], timed_send: list[float]) -> None:
        room = next(room_ids)
        receiver = KVReceiver(decode, addr, room)
        receiver.init()
        receiver.send_metadata(dst_pages, 0)
        senders = [KVSender(p, addr, room) for p in prefill]
        for s in senders:
            s.init(len(src_pages), 0)
        while any(s.poll() == KVPoll.Bootstrapping for s in senders):
            time.sleep(0.0002)
        t0 = time.perf_counter()
        for s in senders:
            s.send(src_pages, True)
        while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        timed_send.append(time.perf_counter() - t0)
        if state != KVPoll.Success:
            raise RuntimeError(f"room {room} failed: {receiver.failure_exception()}")
        for s in senders:
            while s.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0002)
            s.clear()
        receiver.clear()

    def measure(name: str, src_pool: torch.Tensor, dst_pool: torch.Tensor, src_pages: list[int],
                dst_pages: list[int], max_iters: int) -> Row:
        a, b = pair(src_pool, dst_pool)
        bootstrap_server = BootstrapServer("127.0.0.1", 0).start()
        addr = bootstrap_server.address
        a.publish_layout(addr)
        sp, dp = torch.tensor(src_pages), torch.tensor(dst_pages)
        segs = page_segments(a.layout, b.layout, sp.numpy(), dp.numpy(), 0, 0, a.layout.head_count)
        nbytes = segs.nbytes
        batches = segs.batches(config.transfer_max_batch_segments)

        flat_src, flat_dst = _byte_view(src_pool)[:nbytes], _byte_view(dst_pool)[:nbytes]

        def memcpy() -> None:
            ctypes.memmove(dst_pool.data_ptr(), src_pool.data_ptr(), nbytes)

        def sock_send() -> None:
            sock.send(flat_src, flat_dst)

        def mooncake() -> None:
            for srcs, dsts, lens in batches:
                code = a.engine.write(b.layout.session, srcs, dsts, lens)
                if code != 0:
                    raise RuntimeError(f"mooncake write returned {code}")

        sends: list[float] = []

        def room() -> None:
            room_once([a], b, addr, src_pages, dst_pages, sends)

        row = Row(name, nbytes, len(segs),
                  memcpy=_timed(memcpy, nbytes, min_time_s, max_iters),
                  socket=_timed(sock_send, nbytes, min_time_s, max_iters),
                  mooncake=_timed(mooncake, nbytes, min_time_s, max_iters),
                  layer=0.0, room=_timed(room, nbytes, min_time_s, max_iters))
        row.layer = nbytes / statistics.median(sends[1:] or sends) / 1e9
        if not torch.equal(dst_pool[:, :, dp], src_pool[:, :, sp]):
            raise RuntimeError(f"{name}: bytes differ after the transfer")
        bootstrap_server.stop()
        for mgr in (a, b):  # before the pools are freed
            mgr.close()
        return row

    try:
        for size in sizes:
            # One page per buffer of size/2 bytes: K and V of one layer, fp16, 64-wide heads.
            page_size = max(1, size // 2 // (64 * 2))
            src = torch.randn((1, 2, 1, page_size, 1, 64)).to(torch.float16)
            dst = torch.zeros_like(src)
            rows.append(measure(f"{_human(size)} message", src, dst, [0], [0],
                                max_iters=max(3, min(200, (256 * MIB) // size))))
            del src, dst
        if kv_tokens:
            # Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16, 16-token pages (128 KiB/token).
            pages = kv_tokens // 16
            shape = (32, 2, 2 * pages, 16, 8, 128)
            src = torch.randn(shape).to(torch.bfloat16)
            dst = torch.zeros_like(src)
            rows.append(measure(f"KV {kv_tokens} tok contiguous", src, dst, list(range(pages)),
                                list(range(pages, 2 * pages)), max_iters=20))
            gen = torch.Generator().manual_seed(0)
            src_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
            dst_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
            rows.append(measure(f"KV {kv_tokens} tok scattered", src, dst, src_pages, dst_pages, max_iters=20))
            del src, dst
        if head_slice_tokens:
            rows.append(_head_slice_row(head_slice_tokens, config, registry, room_once, min_time_s))
    finally:
        sock.close()
        for mgr in managers:
            mgr.close()
    return rows


def _head_slice_row(tokens: int, config, registry, room_once, min_time_s: float) -> Row:
    """Prefill TP 2 -> decode TP 1: per-token segments, layer only (no raw peer to compare)."""
    import torch

    from splitserve.transfer import BootstrapServer, KVManager, layout_for_pool, make_aux_tensor

    pages = tokens // 16
    server = BootstrapServer("127.0.0.1", 0).start()
    srcs = [torch.randn((32, 2, pages, 16, 4, 128)).to(torch.bfloat16) for _ in range(2)]
    dst = torch.zeros((32, 2, pages, 16, 8, 128), dtype=torch.bfloat16)
    aux = [make_aux_tensor(4) for _ in range(3)]
    prefill = [KVManager(config, layout_for_pool(s, aux[r], tp_size=2, tp_rank=r, num_kv_heads=8),
                         metrics_registry=registry) for r, s in enumerate(srcs)]
    decode = KVManager(config, layout_for_pool(dst, aux[2], num_kv_heads=8), metrics_registry=registry)
    try:
        for p in prefill:
            p.publish_layout(server.address)
        nbytes = dst.numel() * dst.element_size()
        sends: list[float] = []

        def room() -> None:
            room_once(prefill, decode, server.address, list(range(pages)), list(range(pages)), sends)

        room_rate = _timed(room, nbytes, min_time_s, 5)
        for r, s in enumerate(srcs):
            if not torch.equal(dst[..., 4 * r:4 * r + 4, :], s):
                raise RuntimeError("head-sliced bytes differ")

        scratch = torch.empty_like(dst)

        def memcpy() -> None:
            ctypes.memmove(dst.data_ptr(), scratch.data_ptr(), nbytes)

        segments = 2 * 32 * 2 * tokens
        return Row(f"KV {tokens} tok TP2->TP1", nbytes, segments, memcpy=_timed(memcpy, nbytes, min_time_s, 20),
                   socket=0.0, mooncake=0.0, layer=nbytes / statistics.median(sends) / 1e9, room=room_rate)
    finally:
        for mgr in (*prefill, decode):
            mgr.close()
        server.stop()


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MIB else f"{n >> 10} KiB"


def format_rows(rows: Sequence[Row]) -> str:
    """The report table: GB/s per method and the ratios that matter."""
    head = (f"{'workload':<26}{'bytes':>11}{'segs':>7}{'memcpy':>9}{'socket':>9}{'mooncake':>10}{'layer':>9}"
            f"{'room':>9}  {'layer/mc':>8}{'room/mc':>8}{'mc/sock':>8}{'mc/memcpy':>10}")
    lines = ["throughput in GB/s (1e9 B/s); mc = raw Mooncake batch_transfer_sync_write", head, "-" * len(head)]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if a and b else "-"

    for r in rows:
        lines.append(
            f"{r.name:<26}{r.nbytes:>11}{r.segments:>7}{r.memcpy:>9.2f}{r.socket:>9.3f}{r.mooncake:>10.3f}"
            f"{r.layer:>9.3f}{r.room:>9.3f}  {ratio(r.layer, r.mooncake):>8}{ratio(r.room, r.mooncake):>8}"
            f"{ratio(r.mooncake, r.socket):>8}{ratio(r.mooncake, r.memcpy):>10}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints the table; ``--json PATH`` also writes the rows."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--transfer-protocol=cuda_ipc" in argv or ("--transfer-protocol", "cuda_ipc") in itertools.pairwise(argv):
        from splitserve.bench.cuda_ipc import main as cuda_ipc_main  # two processes on one GPU

        return cuda_ipc_main(argv)
    parser = argparse.ArgumentParser(prog="splitserve bench --profile transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES,
                        help="message sizes in bytes, comma-separated (default 4 KiB .. 256 MiB)")
    parser.add_argument("--max-size", type=int, default=None, help="drop sizes above this many bytes")
    parser.add_argument("--kv-tokens", type=int, default=1024,
                        help="tokens of the Llama-3-8B-like KV layout rows (0: skip; 128 KiB per token)")
    parser.add_argument("--head-slice-tokens", type=int, default=64,
                        help="tokens of the TP2->TP1 head-sliced row (0: skip; per-token segments are slow)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds to repeat each measurement")
    parser.add_argument("--json", default="", help="also write the rows as JSON to this path")
    parser.add_argument("--transfer-protocol", choices=("mooncake", "cuda_ipc"), default="mooncake",
                        help="cuda_ipc: KV between two processes on one GPU against a device copy (bench/cuda_ipc.py; "
                             "its own flags follow)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("GLOG_minloglevel", "2")
    logging.basicConfig(level=logging.WARNING)
    sizes = [s for s in args.sizes if args.max_size is None or s <= args.max_size]
    rows = run(sizes, args.kv_tokens, args.min_time, args.head_slice_tokens)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
