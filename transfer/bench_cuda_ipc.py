"""KV transfer between two processes on one GPU over CUDA IPC, against a device copy of the same bytes.

  splitserve bench --profile transfer --transfer-protocol cuda_ipc [--kv-tokens 512,2048,8192]

This process is the prefill (sender); a child process is the decode (receiver), each with its own
Llama-3-8B-like pool (32 layers, 8 KV heads of 128, bf16, 16-token pages: 128 KiB per token).
For each prompt length, with the decode's pages contiguous and scattered:

- ``device copy``: ``torch`` copy of one contiguous tensor of the same bytes, on this GPU (events);
- ``ipc write``: the backend's data path alone (``CudaIpcEngine.write`` of the room's segments into
  the decode's mapped pool, returning once they landed);
- ``room``: a whole room through ``splitserve.transfer``: sender ``send`` to sender ``Success``
  (segment planning, worker thread, copy, status message; the bytes are in the decode's memory
  then), with the decode process polling its receiver as an engine would;

as GB/s (1e9 bytes/s, each byte counted once) and as ratios to the device copy, all in one run.
The decode checks what arrived against the prefill's pages (a position-weighted checksum).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2


def _pool_shape(pages: int) -> tuple[int, ...]:
    return (LAYERS, 2, pages, PAGE, HEADS, HEAD_DIM)


def page_checksum(pool, pages: Sequence[int]) -> int:
    """Sum over the pages' 32-bit words, each page's sum weighted by its position in ``pages``."""
    import torch

    idx = torch.tensor(list(pages), device=pool.device)
    per_page = pool.index_select(2, idx).view(torch.int32).to(torch.int64).sum(dim=(0, 1, 3, 4, 5))
    weights = torch.arange(1, len(pages) + 1, device=pool.device, dtype=torch.int64)
    return int((per_page * weights).sum())


def _decode_child(cfg: dict) -> None:
    """The decode process: a receiver per room asked for on stdin, polled until final."""
    import torch

    from splitserve.transfer import (
        CudaIpcKVManager,
        KVPoll,
        KVReceiver,
        TransferConfig,
        layout_for_pool,
        make_aux_tensor,
    )

    pool = torch.zeros(_pool_shape(cfg["pages"]), dtype=torch.bfloat16, device="cuda")
    aux = make_aux_tensor(4, device="cuda")
    mgr = CudaIpcKVManager(TransferConfig(transfer_protocol="cuda_ipc"), layout_for_pool(pool, aux))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        receiver = KVReceiver(mgr, cmd["bootstrap"], cmd["room"])
        receiver.init()
        receiver.send_metadata(cmd["pages"], 0)
        while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.00005)
        error = receiver.failure_exception()
        checksum = page_checksum(pool, cmd["pages"]) if state == KVPoll.Success else None
        receiver.clear()
        print(json.dumps({"room": cmd["room"], "state": int(state), "checksum": checksum,
                          "error": str(error) if error else None}), flush=True)
    mgr.close()


class DecodeProcess:
    """The child decode process, one JSON line per room each way."""

    def __init__(self, pages: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve.transfer.bench_cuda_ipc",
                                      "--decode-child", json.dumps({"pages": pages})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not self.read(120).get("ready"):
            raise RuntimeError("decode process did not start")

    def ask(self, bootstrap: str, room: int, pages: list[int]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"bootstrap": bootstrap, "room": room, "pages": pages}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError("decode process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"decode process exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_copy_s(nbytes: int, repeats: int) -> float:
    """Median seconds of one contiguous device-to-device copy of ``nbytes`` (events)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    if not torch.equal(dst, src):
        raise RuntimeError("device copy is wrong")
    return statistics.median(times)


class _Prefill:
    """This process's side: a pool of random KV, its manager and bootstrap server, the decode child."""

    def __init__(self, pages_total: int) -> None:
        import torch

        from splitserve.transfer import (
            BootstrapServer,
            CudaIpcKVManager,
            TransferConfig,
            layout_for_pool,
            make_aux_tensor,
        )

        gen = torch.Generator(device="cuda").manual_seed(0)
        self.pool = torch.randn(_pool_shape(pages_total), device="cuda", generator=gen).to(torch.bfloat16)
        self.aux = make_aux_tensor(4, device="cuda")
        self.mgr = CudaIpcKVManager(TransferConfig(transfer_protocol="cuda_ipc"), layout_for_pool(self.pool, self.aux))
        self.server = BootstrapServer("127.0.0.1", 0).start()
        self.mgr.publish_layout(self.server.address)
        self.decode = DecodeProcess(pages_total)
        self.next_room = 1
        # Time the data path inside rooms too (what a room adds around it is the protocol's cost).
        self.writes_in_rooms: list[float] = []
        engine_write = self.mgr.engine.write

        def timed_write(*args: object) -> int:
            t0 = time.perf_counter()
            code = engine_write(*args)
            self.writes_in_rooms.append(time.perf_counter() - t0)
            return code

        self.mgr.engine.write = timed_write  # type: ignore[method-assign]
        self.engine_write = engine_write

    def room(self, src_pages: list[int], dst_pages: list[int], want: int) -> tuple[float, object]:
        """One room; returns (seconds from send to Success, the decode's layout)."""
        from splitserve.transfer import KVPoll, KVSender

        room_id, self.next_room = self.next_room, self.next_room + 1
        sender = KVSender(self.mgr, self.server.address, room_id)
        sender.init(len(src_pages), 0)
        self.decode.ask(self.server.address, room_id, dst_pages)
        while sender.poll() == KVPoll.Bootstrapping:
            time.sleep(0.00005)
        t0 = time.perf_counter()
        sender.send(src_pages, True)
        while (state := sender.poll()) not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.00005)
        elapsed = time.perf_counter() - t0
        answer = self.decode.read(60)
        dst_layout = next(iter(sender._dsts.values())).layout
        error = sender.failure_exception()
        sender.clear()
        if state != KVPoll.Success or answer["state"] != KVPoll.Success:
            raise RuntimeError(f"room {room_id} failed: {error} / {answer['error']}")
        if answer["checksum"] != want:
            raise RuntimeError("the decode's pages differ from the prefill's")
        return elapsed, dst_layout

    def measure(self, tokens: int, name: str, src_pages: list[int], dst_pages: list[int], repeats: int) -> dict:
        import numpy as np

        from splitserve.transfer.transfer_plan import page_segments

        want = page_checksum(self.pool, src_pages)
        self.room(src_pages, dst_pages, want)  # warm-up: the first room maps the decode's pool
        self.writes_in_rooms.clear()
        timed = [self.room(src_pages, dst_pages, want) for _ in range(repeats)]
        room_s = statistics.median(t for t, _ in timed)
        in_room_s = statistics.median(self.writes_in_rooms)
        dst_layout = timed[-1][1]
        segs = page_segments(self.mgr.layout, dst_layout, np.array(src_pages), np.array(dst_pages), 0, 0, HEADS)
        copier = self.mgr.engine.copier
        copier.timed = True
        kernels: list[float] = []

        def write() -> None:
            self.engine_write(dst_layout.session, segs.srcs, segs.dsts, segs.lens)
            kernels.append(copier.last_kernel_s)

        write_s = _median_s(write, repeats)
        copier.timed = False
        kernel_s = statistics.median(kernels[1:])
        copy_s = device_copy_s(segs.nbytes, repeats)
        nbytes = segs.nbytes
        row = {"tokens": tokens, "pages": name, "bytes": nbytes, "segments": len(segs),
               "device_copy_gbps": nbytes / copy_s / 1e9, "kernel_gbps": nbytes / kernel_s / 1e9,
               "ipc_write_gbps": nbytes / write_s / 1e9, "room_gbps": nbytes / room_s / 1e9,
               "kernel_over_copy": copy_s / kernel_s, "ipc_write_over_copy": copy_s / write_s,
               "room_over_copy": copy_s / room_s, "room_ms": room_s * 1e3, "write_in_room_ms": in_room_s * 1e3,
               "write_ms": write_s * 1e3, "kernel_ms": kernel_s * 1e3, "copy_ms": copy_s * 1e3}
        if tokens == self.sweep_tokens:
            row["kernel_sweep"] = self.sweep(dst_layout.session, segs, copy_s)
        return row

    sweep_tokens = 8192
    SWEEP = ((2048, 4, 8, True), (2048, 4, 8, False), (1024, 8, 4, True), (1024, 2, 4, True), (4096, 2, 16, True),
             (4096, 4, 8, True), (512, 8, 4, True))

    def sweep(self, session: str, segs, copy_s: float) -> list[dict]:
        """The copy kernel alone at other block shapes, on the same segments into the mapped peer pool."""
        from splitserve.transfer.segment_copy import CopyShape, SegmentCopier

        local_dsts = self.mgr.engine.mapped_destinations(session, segs.dsts, segs.lens)
        out = []
        for block, iters, warps, pairs in self.SWEEP:
            copier = SegmentCopier(self.mgr.engine.device, CopyShape(block, iters, warps), pairs, timed=True)
            times = []
            for _ in range(6):
                copier.copy(segs.srcs, local_dsts, segs.lens)
                times.append(copier.last_kernel_s)
            kernel_s = statistics.median(times[1:])
            out.append({"block": block, "iters": iters, "warps": warps, "pairs": pairs,
                        "kernel_ms": kernel_s * 1e3, "kernel_over_copy": copy_s / kernel_s})
        return out

    def close(self) -> None:
        self.decode.close()
        self.mgr.close()
        self.server.stop()


def run(token_counts: Sequence[int], repeats: int) -> list[dict]:
    import numpy as np

    pages_total = 2 * (max(token_counts) // PAGE) + 1
    prefill = _Prefill(pages_total)
    rows = []
    try:
        for tokens in token_counts:
            n = tokens // PAGE
            rng = np.random.default_rng(tokens)
            rows.append(prefill.measure(tokens, "contiguous", list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)),
                                        repeats))
            rows.append(prefill.measure(tokens, "scattered", rng.permutation(np.arange(1, pages_total))[:n].tolist(),
                                        rng.permutation(np.arange(1, pages_total))[:n].tolist(), repeats))
    finally:
        prefill.close()
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    head = (f"{'KV tokens':>9} {'pages':<11}{'bytes':>12}{'segs':>7}{'copy GB/s':>10}{'kernel':>8}{'write':>8}"
            f"{'room':>8}{'room ms':>9}{'in-room write ms':>17}  {'kernel/copy':>11}{'write/copy':>11}"
            f"{'room/copy':>10}")
    lines = ["GB/s = 1e9 bytes/s, each byte counted once; copy = one contiguous device copy of the same bytes;",
             "kernel = the IPC write's copy kernels alone (events), write = the whole IPC write call, room = send to "
             "Success", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tokens']:>9} {r['pages']:<11}{r['bytes']:>12}{r['segments']:>7}"
                     f"{r['device_copy_gbps']:>10.0f}{r['kernel_gbps']:>8.0f}{r['ipc_write_gbps']:>8.0f}"
                     f"{r['room_gbps']:>8.0f}{r['room_ms']:>9.3f}{r['write_in_room_ms']:>17.3f}  "
                     f"{r['kernel_over_copy']:>11.2f}{r['ipc_write_over_copy']:>11.2f}{r['room_over_copy']:>10.2f}")
    for r in rows:
        for k in r.get("kernel_sweep", []):
            lines.append(f"  sweep {r['tokens']} {r['pages']}: block {k['block']} x{k['iters']} warps {k['warps']} "
                         f"pairs {k['pairs']}: {k['kernel_ms']:.3f} ms, kernel/copy {k['kernel_over_copy']:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints the table; ``--json PATH`` also writes the rows."""
    parser = argparse.ArgumentParser(prog="splitserve bench --profile transfer --transfer-protocol cuda_ipc",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfer-protocol", choices=["cuda_ipc"], default="cuda_ipc")
    parser.add_argument("--kv-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 8192],
                        help="prompt lengths (multiples of 16; 128 KiB of KV per token)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each measurement (median)")
    parser.add_argument("--json", default="", help="also write the rows as JSON to this path")
    parser.add_argument("--decode-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_child:
        _decode_child(json.loads(args.decode_child))
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("--transfer-protocol cuda_ipc needs a CUDA device")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    rows = run(args.kv_tokens, args.repeats)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
