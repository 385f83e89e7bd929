"""The prefill's Python per KV room on a CPU: the cuda_ipc room pipeline without a GPU.

  python3 -P benchmarks/room_pipeline_cpu.py [--rooms 256] [--tokens 512] [--sets 20] [--mode one-thread]

The H200's 256 x 512-token sets are bound by the prefill process's Python (``bench --profile transfer``:
~75-90 us of CPU a room, the copies 35). This runs the same pipeline on a CPU: the bench's prefill and
decode processes (``bench/cuda_ipc.py``) over Mooncake TCP with a small head (64 buffers of few
bytes), the writes merged, pipelined and sent as page runs as cuda_ipc's are, with the copy left out:
``launch_pages`` plans the kernel's table (``plan_runs``) and returns at once, so nothing lands in the decode's
pool (its checksums are not compared) and what is timed is the host's work around the copies.

``--mode one-thread``: the engine thread's ``send`` calls of a set, then the worker's merged batch run on this
thread (no other thread competes for the GIL or the manager's lock): each side's thread CPU a room, the least
over the sets (on a shared machine CPU time grows with contention). ``--mode threaded``: the bench's own sets
(the engine thread's sends with the worker and the control thread running beside them): every Python thread's
CPU a room, and each set's wall time from the first send to the decode's last Success. With ``--copy-gbps``
(threaded) each launch stands for a copy of Llama-3-8B's pages at that rate on one simulated stream
(``SimulatedStream``), and a set's wall reads against its copies' time as the H200's rooms bench reads against
the device copy: at 1930 GB/s a 2-core CPU gave 0.5-0.6 (median sets 16-18 ms against 8.9 of copy), where the H200
read 0.48-0.53; the timeline showed the worker starting only once the engine thread's 256
send calls (4.4-6 ms) were done, the GIL's 5 ms switch interval holding it off.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time

import numpy as np

from splitserve.transfer import KVSender, bench_cuda_ipc, segment_copy
from splitserve.transfer.cuda_ipc.segment_copy import plan_runs
from splitserve.transfer.poll_state import KVPoll

PAGE = bench_cuda_ipc.PAGE
BASES = np.arange(64, dtype=np.int64) << 20  # stand-in buffer bases for the kernel's table


def launch_without_copy(session: str, runs) -> object:
    """``CudaIpcEngine.launch_pages`` up to the table, for any transport: the copy is left out."""
    plan_runs(BASES, BASES, runs.src_offs, runs.dst_offs, runs.lens, (runs.aux.srcs, runs.aux.dsts, runs.aux.lens), 0)
    return lambda: 0


class SimulatedStream:
    """A device stream's copies stood in by the clock: a launch is queued behind the copies before it and takes
    ``pages x page_bytes / gbps``; waiting for it polls as ``SegmentCopier.finish`` does (sleeps of ``POLL_S``).
    So the host's work around the copies meets a copy time as the H200's (Llama-3-8B: 2 MiB a 16-token page,
    ~1.93 TB/s), and a set's wall can be read against the copies' own."""

    def __init__(self, gbps: float, page_bytes: int = 2 << 20) -> None:
        self.seconds_per_page = page_bytes / (gbps * 1e9)
        self.free_at = 0.0
        self.busy_s = 0.0  # the copies' time, summed (the set's own copy time)

    def launch(self, session: str, runs) -> object:
        launch_without_copy(session, runs)
        pages = int(runs.lens.sum()) // runs.src.buffers[0].page_bytes
        start = max(time.perf_counter(), self.free_at)
        self.free_at = end = start + pages * self.seconds_per_page
        self.busy_s += end - start

        def landed() -> int:
            while time.perf_counter() < end:
                time.sleep(segment_copy.POLL_S)
            return 0
        return landed


def prefill(rooms: int, tokens: int, stream: SimulatedStream | None = None) -> bench_cuda_ipc._Prefill:
    """The bench's prefill side over Mooncake TCP, made to take cuda_ipc's path through the room pipeline
    (its copies timed by ``stream`` where given, else left out)."""
    bench_cuda_ipc.page_checksum = lambda pool, pages: 0  # nothing lands: neither side's pages are compared
    side = bench_cuda_ipc._Prefill("tcp", 32, tokens // PAGE * rooms + 1, rooms, 1, head_dim=8, merge_writes=True)
    mgr = side.mgr
    mgr.config = mgr.config.replace(transfer_max_batch_segments=1 << 20)  # cuda_ipc's: one write takes every room
    mgr.engine.quick_writes = True
    launch = launch_without_copy if stream is None else stream.launch
    mgr.engine.write_pages = lambda session, runs: launch(session, runs)()
    mgr.writers.launch_pages = launch
    mgr.workers.launch_pages = lambda *args: mgr.writers.launch_pages(*args)
    side.clock = bench_cuda_ipc._StageClock(mgr)
    side.stream = stream  # threaded_set reads its copies' time
    return side


def page_lists(rooms: int, tokens: int, name: str, pages_total: int) -> tuple[list[list[int]], list[list[int]]]:
    n = tokens // PAGE
    rng = np.random.default_rng(1)
    lists = []
    for _ in range(2):
        order = np.arange(1, pages_total) if name == "contiguous" else rng.permutation(np.arange(1, pages_total))
        lists.append([order[i * n:(i + 1) * n].tolist() for i in range(rooms)])
    return lists[0], lists[1]


def one_thread_set(side: bench_cuda_ipc._Prefill, src: list[list[int]], dst: list[list[int]]) -> dict[str, float]:
    """One set with the worker's part run here: the send calls' and the merged batch's thread CPU a room."""
    mgr, count = side.mgr, len(src)
    ids = list(range(side.next_room, side.next_room + count))
    side.next_room += count
    side.finals.watch(ids)
    senders = [KVSender(mgr, side.server.address, room) for room in ids]
    for k, (sender, pages) in enumerate(zip(senders, src, strict=True)):
        sender.init(len(pages), k % side.aux.shape[0])
    side.decode.ask(side.server.address, ids, dst)
    bench_cuda_ipc._wait_all(mgr, senders, lambda s: s.poll() != KVPoll.Bootstrapping, 60)
    jobs: list = []
    submit, mgr.submit = mgr.submit, jobs.append
    try:
        t0 = time.thread_time()
        for sender, pages in zip(senders, src, strict=True):
            sender.send(pages, True)
        t1 = time.thread_time()
        mgr.workers._run_merged(jobs)
        t2 = time.thread_time()
    finally:
        mgr.submit = submit
    side.finals.wait(60)
    answer = side.decode.read(60)
    for sender in senders:
        sender.clear()
    if any(state != KVPoll.Success for state in answer["states"]):
        raise RuntimeError(f"rooms failed: {answer['errors']}")
    return {"send_us": (t1 - t0) / count * 1e6, "worker_us": (t2 - t1) / count * 1e6}


def threaded_set(side: bench_cuda_ipc._Prefill, src: list[list[int]], dst: list[list[int]]) -> dict[str, float]:
    """One of the bench's sets: each Python thread's CPU a room (the worker's outside its write calls), the wall."""
    before, write_cpu = bench_cuda_ipc.python_threads_cpu(), side.clock.write_cpu_s
    stream: SimulatedStream | None = side.stream
    busy0 = stream.busy_s if stream is not None else 0.0
    marks = side.rooms(src, dst, [0] * len(src))
    per: collections.Counter[str] = collections.Counter()
    for ident, (name, cpu) in bench_cuda_ipc.python_threads_cpu().items():
        per[name.split("-tcp")[0]] += cpu - before.get(ident, ("", 0.0))[1]
    per["transfer-worker"] -= side.clock.write_cpu_s - write_cpu
    out = {f"{name}_us": cpu / len(src) * 1e6 for name, cpu in per.items()}
    out["send_calls_us"] = marks["send_calls_cpu_s"] / len(src) * 1e6
    out["total_ms"] = (marks["decode_success"] - marks["t0"]) * 1e3
    if stream is not None:  # the set's copies against its wall: what the H200's rooms bench reads as "/copy"
        out["copy_ms"] = (stream.busy_s - busy0) * 1e3
        out["over_copy"] = out["copy_ms"] / out["total_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, default=256, help="rooms in a set, sent at once")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens of a room (a multiple of 16)")
    parser.add_argument("--sets", type=int, default=20, help="sets of each page order")
    parser.add_argument("--mode", choices=["one-thread", "threaded"], default="one-thread")
    parser.add_argument("--copy-gbps", type=float, default=0.0,
                        help="threaded: time each copy as Llama-3-8B's pages at this rate on one simulated stream "
                             "(the H200's device copy: ~1930); 0 leaves the copies out")
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # before Mooncake starts (the managers)
    os.environ.setdefault("GLOG_minloglevel", "2")
    logging.basicConfig(level=logging.WARNING)
    stream = SimulatedStream(args.copy_gbps) if args.copy_gbps > 0 else None
    side = prefill(args.rooms, args.tokens, stream)
    pages_total = args.tokens // PAGE * args.rooms + 1
    try:
        for name in ("contiguous", "scattered"):
            src, dst = page_lists(args.rooms, args.tokens, name, pages_total)
            run_set = one_thread_set if args.mode == "one-thread" else threaded_set
            side.rooms([[1]], [[1]], [0])  # the worker lane and the peer's session warm
            results = [run_set(side, src, dst) for _ in range(args.sets)]
            keys = sorted({k for r in results for k in r})
            print(f"{args.rooms} x {args.tokens} {name} ({args.mode}), least / median over {args.sets} sets: "
                  + ", ".join(f"{k} {min(r[k] for r in results):.1f} / {statistics.median(r[k] for r in results):.1f}"
                              for k in keys), flush=True)
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
