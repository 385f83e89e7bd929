"""What Mooncake's NVLink transports need on one GPU, and what they move there.

  python benchmarks/mooncake_nvlink_probe.py [--variants tcp nvlink nvlink_ipc nvlink_intra] [--output F]

Two processes on one GPU, each with a Llama-3-8B-shaped KV pool (32 layers x K/V, 16-token pages of 8 heads
x 128, bf16: 32 KiB a page and buffer, 128 KiB a token) in one torch allocation that Mooncake registers at its
base, as the engine registers its pool. The prefill writes KV rooms of 512 and 8,192 tokens into
the decode's pool with ``batch_transfer_sync_write``, the call ``transfer/mooncake/engine.py`` makes: pages
consecutive on the decode (64 segments, one per buffer) and scattered (one 32 KiB segment a page and buffer).
Writes go in the engine's batches (``Segments.batches`` of ``transfer_max_batch_segments``, 1,024). The
decode zeroes its pool before each pattern and then checks every written byte against the source, which it
rebuilds from the same seed, and that nothing else in the allocation changed. A second decode allocation is
registered from 1 MiB past its base (as a buffer inside a larger torch allocation would be) and checked the same
way: a transport that maps the allocation's IPC handle as if it began at the registered address writes 1 MiB
early.

Variants (each a fresh pair of processes, both spawned, with the environment set before mooncake is imported):
- ``tcp``: Mooncake's TCP transport on loopback, what the engine's ``--transfer-protocol tcp`` uses;
- ``nvlink``: protocol "nvlink" (``NvlinkTransport``, built with USE_MNNVL), default environment;
- ``nvlink_ipc``: the same with ``MC_USE_NVLINK_IPC=1`` (legacy CUDA IPC handles instead of fabric ones);
- ``nvlink_intra``: protocol "nvlink_intra" with ``MC_INTRANODE_NVLINK=1`` (``IntraNodeNvlinkTransport``).

What it found on one H200 with ``mooncake-transfer-engine-cuda13==0.3.14`` (docs/transfer.md, "Why not
Mooncake's own GPU transports"): ``nvlink`` does not initialize (no USE_MNNVL in that build), ``nvlink_intra``
works with torch's allocations and costs 5.5-7 us a segment.

Each pattern is timed over repeats (best and median of the sync calls); GB/s = 1e9 bytes/s, each byte once,
against one contiguous device copy of the same bytes in the sender, timed as the CUDA IPC rooms bench times it
(``bench_cuda_ipc.device_copy_s``, the median). Results are printed as JSON lines
and, with ``--output``, written as one JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import time

import numpy as np

from splitserve.bench.cuda_ipc import HEAD_DIM, HEADS, PAGE, device_copy_s
from splitserve.transfer.config import TransferConfig
from splitserve.transfer.kv.plan import Segments

log = logging.getLogger("mooncake_nvlink_probe")

LAYERS = 32
PAGE_BYTES = PAGE * HEADS * HEAD_DIM * 2  # one page of one buffer (K or V of one layer)
BUFFERS = LAYERS * 2
POOL_PAGES = 640  # 10,240 tokens: room for the 8,192-token room anywhere in the pool
SEED = 1234
OFFSET_REGISTRATION = 1 << 20
REPLY_TIMEOUT_S = 120.0


class DecodeFailed(RuntimeError):
    """The decode process reported an error, died or went quiet."""

VARIANTS = {
    "tcp": ("tcp", {}),
    "nvlink": ("nvlink", {}),
    "nvlink_ipc": ("nvlink", {"MC_USE_NVLINK_IPC": "1"}),
    "nvlink_intra": ("nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}),
}


def room_segments(tokens: int, scattered: bool) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, length) in bytes from the pools' bases for one room: the source
    pages are 0..n-1 in every buffer; the destination pages are consecutive (one segment per buffer) or a
    seeded permutation of the pool's pages (one segment per page and buffer)."""
    pages = tokens // PAGE
    buffer_bytes = POOL_PAGES * PAGE_BYTES
    if not scattered:
        return [(b * buffer_bytes, b * buffer_bytes, pages * PAGE_BYTES) for b in range(BUFFERS)]
    dst_pages = random.Random(SEED + tokens).sample(range(POOL_PAGES), pages)
    return [(b * buffer_bytes + p * PAGE_BYTES, b * buffer_bytes + d * PAGE_BYTES, PAGE_BYTES)
            for b in range(BUFFERS) for p, d in enumerate(dst_pages)]


def source_pool(device: str):
    """The sender's pool: seeded random bytes, rebuilt bit for bit by the receiver for its check."""
    import torch

    g = torch.Generator(device=device).manual_seed(SEED)
    return torch.randint(0, 256, (BUFFERS * POOL_PAGES * PAGE_BYTES,), dtype=torch.uint8, device=device,
                         generator=g)


def new_engine(protocol: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    code = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if code != 0:
        raise RuntimeError(f"TransferEngine.initialize(protocol={protocol!r}) returned {code}")
    return engine


def receiver(conn, protocol: str, env: dict[str, str]) -> None:
    """The decode: registers its pool, then zeroes / checks on the sender's requests."""
    os.environ.update(env)
    import torch

    try:
        engine = new_engine(protocol)
        size = BUFFERS * POOL_PAGES * PAGE_BYTES
        pools = {0: torch.zeros(size, dtype=torch.uint8, device="cuda"),
                 OFFSET_REGISTRATION: torch.zeros(size + OFFSET_REGISTRATION, dtype=torch.uint8, device="cuda")}
        codes = {shift: engine.register_memory(pool.data_ptr() + shift, size) for shift, pool in pools.items()}
        conn.send(("ready", f"127.0.0.1:{engine.get_rpc_port()}",
                   {shift: pool.data_ptr() + shift for shift, pool in pools.items()}, codes))
        source = source_pool("cuda")
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "zero":
                for pool in pools.values():
                    pool.zero_()
                torch.cuda.synchronize()
                conn.send(("zeroed",))
            elif msg[0] == "check":
                _, segments, shift = msg
                torch.cuda.synchronize()
                pool = pools[shift]
                bad = sum(int(not torch.equal(pool[shift + d:shift + d + n], source[s:s + n]))
                          for s, d, n in segments)
                stray = int(pool.count_nonzero()) - sum(int(source[s:s + n].count_nonzero()) for s, _, n in segments)
                conn.send(("checked", bad, stray))
    except Exception as exc:  # reported to the sender, which records it as the variant's result
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def ask(conn, message: tuple | None) -> tuple:
    """Sends ``message`` (None: only waits) and returns the decode's reply; a decode that reported an error, died
    or went quiet raises, naming it."""
    if message is not None:
        conn.send(message)
    if not conn.poll(REPLY_TIMEOUT_S):
        raise DecodeFailed(f"decode: no reply within {REPLY_TIMEOUT_S:.0f} s")
    try:
        reply = conn.recv()
    except EOFError:
        raise DecodeFailed("decode: exited without a reply") from None
    if reply[0] == "error":
        raise DecodeFailed("decode: " + reply[1])
    return reply


def run_variant(name: str, repeats: int) -> dict:
    """One variant, in a process of its own (so no Mooncake state carries over from another variant)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=sender, args=(child, name, repeats))
    proc.start()
    child.close()
    try:
        if parent.poll(REPLY_TIMEOUT_S * 4):
            return parent.recv()
        return {"variant": name, "patterns": [], "error": "prefill: no result in time"}
    except EOFError:
        return {"variant": name, "patterns": [], "error": f"prefill: exited with code {proc.exitcode}"}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def sender(out, name: str, repeats: int) -> None:
    """The prefill: spawns the decode, writes every pattern, sends its result to the probe's main process."""
    protocol, env = VARIANTS[name]
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, protocol, env), daemon=True)
    proc.start()
    child.close()
    result: dict = {"variant": name, "protocol": protocol, "env": env, "patterns": []}
    try:
        _, session, dst_bases, reg_codes = ask(parent, None)
        result["decode_register_memory"] = {str(k): v for k, v in reg_codes.items()}
        import torch

        engine = new_engine(protocol)
        max_segments = TransferConfig().transfer_max_batch_segments
        source = source_pool("cuda")
        result["prefill_register_memory"] = engine.register_memory(source.data_ptr(), source.numel())
        for shift in (0, OFFSET_REGISTRATION):
            for tokens in (512, 8192):
                for scattered in (False, True):
                    if shift and (tokens, scattered) != (512, True):
                        continue  # the offset registration is a correctness question: one pattern answers it
                    segments = room_segments(tokens, scattered)
                    row = {"tokens": tokens, "pages": "scattered" if scattered else "contiguous",
                           "segments": len(segments), "bytes": sum(n for _, _, n in segments),
                           "registered_at": "base" if not shift else f"base + {shift}"}
                    ask(parent, ("zero",))
                    offsets = np.array(segments, dtype=np.int64).reshape(-1, 3)
                    batches = Segments(offsets[:, 0] + source.data_ptr(), offsets[:, 1] + dst_bases[shift],
                                       offsets[:, 2]).batches(max_segments)
                    times, codes = [], []
                    for _ in range(repeats):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for srcs, dsts, lens in batches:
                            codes.append(int(engine.batch_transfer_sync_write(session, srcs, dsts, lens)))
                        torch.cuda.synchronize()  # a sync write is done on return; this makes sure of it
                        times.append(time.perf_counter() - t0)
                    _, bad, stray = ask(parent, ("check", segments, shift))
                    copy_s = device_copy_s(row["bytes"], 5, "cuda")
                    row.update(codes=sorted(set(codes)), best_s=min(times), median_s=statistics.median(times),
                               gb_s=row["bytes"] / min(times) / 1e9, copy_gb_s=row["bytes"] / copy_s / 1e9,
                               over_copy=copy_s / min(times), segments_wrong=bad, stray_nonzero_bytes=stray)
                    result["patterns"].append(row)
                    print(json.dumps({"variant": name, **row}), flush=True)
    except DecodeFailed as exc:  # one variant's failure is its result; the others still run
        result["error"] = str(exc)
    except Exception as exc:
        result["error"] = f"prefill: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(OSError):  # the decode may be gone already
            parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        result["decode_exit_code"] = proc.exitcode
    out.send(result)


def allocator_backend() -> str:
    """What Mooncake's NVLink allocator (nvlink_allocator.so, SGLang's custom memory pool) would use here."""
    try:
        from mooncake.allocator import NVLinkAllocator

        return NVLinkAllocator.detect_mem_backend().name
    except Exception as exc:  # reported, not fatal: the probe is about what is missing
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    import torch

    props = torch.cuda.get_device_properties(0)
    report = {"device": props.name, "allocator_backend": allocator_backend(), "variants": []}
    log.info("device %s; Mooncake's NVLink allocator backend here: %s", props.name, report["allocator_backend"])
    for name in args.variants:
        report["variants"].append(run_variant(name, args.repeats))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(report, f, indent=1)
    for v in report["variants"]:
        if "error" in v:
            print(f"{v['variant']:<13} error: {v['error']}")
        for r in v["patterns"]:
            print(f"{v['variant']:<13} {r['tokens']:>5} {r['pages']:<10} {r['registered_at']:<16} "
                  f"{r['segments']:>6} seg  {r['gb_s']:8.2f} GB/s  {r['over_copy']:.4f} of copy "
                  f"({r['copy_gb_s']:.0f} GB/s)  codes {r['codes']}  wrong {r['segments_wrong']}  "
                  f"stray {r['stray_nonzero_bytes']}")


if __name__ == "__main__":
    main()
