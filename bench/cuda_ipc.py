"""KV rooms between two processes on one host, against a device copy of the same bytes.

  splitserve bench --profile transfer --transfer-protocol cuda_ipc [--kv-tokens 512,2048,8192]
  python -m splitserve.bench.cuda_ipc --transfer-protocol tcp --layers 1 --kv-tokens 16
      (no GPU: the same room pipeline over Mooncake TCP on loopback, host memory)

This process is the prefill (sender); a child process is the decode (receiver), each with its own
Llama-3-8B-like pool (32 layers, 8 KV heads of 128, bf16, 16-token pages: 128 KiB per token).

One room at a time, for each prompt length, decode pages contiguous and scattered:
- ``copy``: one contiguous ``torch`` copy of the same bytes on the same device (events);
- ``kernel``: the IPC write's copy kernel alone (events); ``write``: the write alone (plan, table upload,
  launch, wait), three ways: ``CudaIpcEngine.write`` of the segment table (``segments_*``), and
  ``write_pages`` of page runs with the polled and the blocking wait (``runs_poll_*``, ``runs_block_*``;
  ``write_ms`` / ``kernel_ms`` are the path rooms take);
- ``room``: sender ``send`` to the decode's receiver seeing ``Success`` (the bytes are in its pool),
  taken apart: the ``send`` call, the hand-off to the worker thread, planning, the write, the
  sender's bookkeeping, and the status message to the decode process. Both processes read
  ``CLOCK_MONOTONIC`` (``time.perf_counter``), so their timestamps compare; both wait on rooms with
  ``wait`` / state listeners (no sleep-polling).

Many rooms in flight (``--concurrent 512x256``: 256 rooms of 512 tokens sent at once, as 256
prefills finishing together would): from the first ``send`` to the decode seeing the last room's
``Success``, against the same number of back-to-back device copies of one room's bytes.

Prefill CPU, from the rooms' creation (their metadata's arrival included) to the last ``Success``:
``cpu`` is the whole process's (every thread, Mooncake's too), ``ctl`` its Python threads'
outside the write calls (what the room pipeline costs besides moving bytes), ``thr`` its control
thread's (decoding every control message); ``ctl`` and ``thr`` are the least over the repeats (CPU time
grows with contention on a shared box), ``cpu`` the median. ``--head-dim 8`` keeps the 64 buffers but few bytes, so
the pipeline's CPU shows over ``tcp`` on a CPU box.

GB/s = 1e9 bytes/s, each byte counted once; ratios to the copy in the same run. The decode checks
every room's pages against the prefill's (a position-weighted checksum).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from splitserve.transfer.poll_state import KVPoll, is_final

HEADS, HEAD_DIM, PAGE = 8, 128, 16
STAGES = ("send_call", "to_worker", "plan", "write", "bookkeeping", "to_decode")


def _pool_shape(layers: int, pages: int, head_dim: int = HEAD_DIM) -> tuple[int, ...]:
    return (layers, 2, pages, PAGE, HEADS, head_dim)


def _device(protocol: str) -> str:
    return "cuda" if protocol == "cuda_ipc" else "cpu"


def _new_manager(protocol: str, pool, aux, lanes: int):
    from splitserve.transfer import TransferConfig, layout_for_pool, new_kv_manager

    return new_kv_manager(TransferConfig(transfer_protocol=protocol, transfer_threads=lanes),
                          layout_for_pool(pool, aux))


def page_checksum(pool, pages: Sequence[int]) -> int:
    """Sum over the pages' 32-bit words, each page's sum weighted by its position in ``pages``."""
    import torch

    idx = torch.tensor(list(pages), device=pool.device)
    per_page = pool.index_select(2, idx).view(torch.int32).to(torch.int64).sum(dim=(0, 1, 3, 4, 5))
    weights = torch.arange(1, len(pages) + 1, device=pool.device, dtype=torch.int64)
    return int((per_page * weights).sum())


class _Finals:
    """A manager's state listener: which of the watched rooms are final, when the last one got there, and
    an event once all are (the waiting thread sleeps until then, instead of waking on every change and
    taking the manager's lock from the rooms it waits for)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.done = threading.Event()
        self._left: set[int] = set()

    def watch(self, rooms: Sequence[int]) -> None:
        """Call before the rooms can finish (before their senders / receivers exist)."""
        self._left = set(rooms)
        self.done.clear()

    def wait(self, timeout_s: float) -> float:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"{len(self._left)} rooms not final after {timeout_s:g}s")
        return self.at

    def __call__(self, room: int, state: KVPoll) -> None:
        if is_final(state) and room in self._left:
            self._left.discard(room)
            self.at = time.perf_counter()
            if not self._left:
                self.done.set()


def _wait_all(mgr, rooms: Sequence, done: Callable[[object], bool], timeout_s: float) -> None:
    """Blocks (on the manager's state changes) until ``done(room)`` holds for every room. Looks only from
    the first room not done yet: a check of every room on every change would hold the manager's lock
    O(rooms^2) times and slow the very rooms it waits for (deadlines are the control thread's)."""
    deadline = time.monotonic() + timeout_s
    first = 0
    with mgr.lock:
        while True:
            while first < len(rooms) and done(rooms[first]):
                first += 1
            if first == len(rooms):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rooms not done after {timeout_s:g}s: room {first} is {rooms[first].poll()!r}")
            mgr.wait_locked(0.05)


def _freeze_heap() -> None:
    """As the engine does at start (``Engine.start``): the set-up's objects (torch's, the pools') out of the
    cyclic GC, so a full collection does not land in a measured set (on a 2-core CPU one took 12-108 ms with
    ~200k objects tracked; on an H200, without the freeze, single sets with 120 ms of CPU in the send loop)."""
    gc.collect()
    gc.freeze()


def _decode_child(cfg: dict) -> None:
    """The decode process: a set of receivers per line on stdin, answered once all are final."""
    import torch

    from splitserve.transfer import KVReceiver, make_aux_tensor

    device = _device(cfg["protocol"])
    pool = torch.zeros(_pool_shape(cfg["layers"], cfg["pages"], cfg["head_dim"]), dtype=torch.bfloat16, device=device)
    aux = make_aux_tensor(cfg["aux_slots"], device=device)
    mgr = _new_manager(cfg["protocol"], pool, aux, 2)
    finals = _Finals()
    mgr.add_state_listener(finals)
    _freeze_heap()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        receivers = []
        finals.watch(cmd["rooms"])
        for i, (room, pages) in enumerate(zip(cmd["rooms"], cmd["pages"], strict=True)):
            receiver = KVReceiver(mgr, cmd["bootstrap"], room)
            receiver.init()
            receiver.send_metadata(pages, i % cfg["aux_slots"])
            receivers.append(receiver)
        done_at = finals.wait(120)
        states = [int(r.poll()) for r in receivers]
        errors = [str(r.failure_exception()) for r in receivers if r.failure_exception() is not None]
        checksums = [page_checksum(pool, p) if s == KVPoll.Success else None
                     for p, s in zip(cmd["pages"], states, strict=True)]
        for r in receivers:
            r.clear()
        print(json.dumps({"states": states, "errors": errors[:3], "checksums": checksums, "done_at": done_at}),
              flush=True)
    mgr.close()


class DecodeProcess:
    """The child decode process, one JSON line per set of rooms each way."""

    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "splitserve.bench.cuda_ipc",
                                      "--decode-child", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not self.read(120).get("ready"):
            raise RuntimeError("decode process did not start")

    def ask(self, bootstrap: str, rooms: list[int], pages: list[list[int]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"bootstrap": bootstrap, "rooms": rooms, "pages": pages}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        poller = select.poll()  # not select.select: it cannot watch a descriptor numbered 1024 or more
        poller.register(self.proc.stdout, select.POLLIN | select.POLLHUP)
        if not poller.poll(timeout_s * 1e3):
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


def device_copy_s(nbytes: int, repeats: int, device: str, back_to_back: int = 1) -> float:
    """Median seconds of ``back_to_back`` contiguous copies of ``nbytes`` in a row (events on a GPU)."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device == "cpu":
        return _median_s(lambda: [dst.copy_(src) for _ in range(back_to_back)], repeats)
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    if not torch.equal(dst, src):
        raise RuntimeError("device copy is wrong")
    return statistics.median(times)


def python_threads_cpu() -> dict[int, tuple[str, float]]:
    """(name, CPU seconds so far) of each live Python thread of this process (Mooncake's own excluded)."""
    out = {}
    for thread in threading.enumerate():
        with contextlib.suppress(OSError, TypeError):  # ended meanwhile
            out[thread.ident] = (thread.name, time.clock_gettime(time.pthread_getcpuclockid(thread.ident)))
    return out


def cpu_since(before: dict[int, tuple[str, float]]) -> tuple[float, float]:
    """CPU the Python threads spent since ``before`` (threads started since count whole): all of them, and
    the control thread's (it decodes every control message)."""
    total = control = 0.0
    for ident, (name, cpu) in python_threads_cpu().items():
        spent = cpu - before.get(ident, ("", 0.0))[1]
        total += spent
        if name.startswith("transfer-control"):
            control += spent
    return total, control


class _StageClock:
    """Timestamps of the prefill's side of one room at a time (``stages`` on): the worker job's start and end
    (wrapping the manager's ``submit``) and the write's (wrapping the data path's ``write`` and
    ``launch_pages``, to the copy landed); and, always, what the data path's calls cost: their count, the
    calling threads' CPU inside them, and (CUDA IPC, one lane) the copier's host part, wait and kernel (summed
    per copy: with pipelined copies the waits overlap the host's work)."""

    def __init__(self, mgr) -> None:
        self.marks: dict[str, float] = {}
        self.stages = False
        self.writes = 0  # calls into the data path (merged writes count once)
        self.write_cpu_s = 0.0  # CPU of the calling threads inside those calls (Mooncake TCP spins in them)
        self.copier_s = {"host": 0.0, "wait": 0.0, "kernel": 0.0}
        copier = getattr(mgr.engine, "copier", None)
        lock = threading.Lock()
        submit, write, self.engine_write = mgr.submit, mgr.writers.write, mgr.engine.write

        def timed_submit(job) -> None:
            if not self.stages:  # sets of rooms: no wrapper per job (it would cost the rooms it measures)
                submit(job)
                return

            def run() -> None:
                self.marks.setdefault("job", time.perf_counter())
                job.run()
                self.marks["job_end"] = time.perf_counter()

            def merge():
                self.marks.setdefault("job", time.perf_counter())
                return job.merge()

            submit(dataclasses.replace(job, run=run, merge=merge if job.merge is not None else None))

        lists = not getattr(mgr.engine, "takes_arrays", False)  # Mooncake with --merge-writes gets arrays

        def timed(call):
            def wrapped(*args, launch_cpu: float = 0.0) -> int:
                if self.stages:
                    self.marks.setdefault("write", time.perf_counter())
                cpu0 = time.thread_time()
                code = call(*args)
                if self.stages:
                    self.marks["write_end"] = time.perf_counter()
                with lock:
                    self.writes += 1
                    self.write_cpu_s += time.thread_time() - cpu0 + launch_cpu
                    if copier is not None:
                        self.copier_s["host"] += copier.last_host_s
                        self.copier_s["wait"] += copier.last_wait_s
                        self.copier_s["kernel"] += copier.last_kernel_s if copier.timed else 0.0
                return code
            return wrapped

        def batched_write(session, *arrays) -> int:
            if not lists:
                return write(session, *arrays)
            step = mgr.config.transfer_max_batch_segments  # in Mooncake-sized batches
            code = 0
            for i in range(0, len(arrays[0]), step):
                code = code or write(session, *(list(a[i:i + step]) for a in arrays))
            return code

        def timed_launch(launch):
            def wrapped(*args):
                cpu0 = time.thread_time()
                if self.stages:
                    self.marks.setdefault("write", time.perf_counter())
                landed = launch(*args)
                launch_cpu = time.thread_time() - cpu0
                return lambda: timed(lambda: landed())(launch_cpu=launch_cpu)
            return wrapped

        mgr.submit = timed_submit
        mgr.writers.write = timed(batched_write)
        if mgr.workers.launch_pages is not None:
            self.engine_write_pages = mgr.engine.write_pages
            mgr.writers.launch_pages = timed_launch(mgr.writers.launch_pages)


class _Prefill:
    """This process's side: a pool of random KV, its manager and bootstrap server, the decode child."""

    def __init__(self, protocol: str, layers: int, pages_total: int, aux_slots: int, lanes: int,
                 head_dim: int = HEAD_DIM, merge_writes: bool = False) -> None:
        import torch

        from splitserve.transfer import BootstrapServer, make_aux_tensor

        self.protocol, self.device, self.layers = protocol, _device(protocol), layers
        self.pool = torch.empty(_pool_shape(layers, pages_total, head_dim), dtype=torch.bfloat16, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.pool.view(torch.int16).random_(generator=gen)  # in place: no float temporary of the pool's size
        self.page_bytes = self.pool[0, 0, 0].numel() * self.pool.element_size() * 2 * layers  # every buffer's
        self.aux = make_aux_tensor(aux_slots, device=self.device)
        self.mgr = _new_manager(protocol, self.pool, self.aux, lanes)
        if merge_writes:  # tcp: queued rooms share a Mooncake write as cuda_ipc's share a copy (their CPU shows)
            self.mgr.engine.merges_writes = True
        self.finals = _Finals()
        self.mgr.add_state_listener(self.finals)
        self.server = BootstrapServer("127.0.0.1", 0).start()
        self.mgr.publish_layout(self.server.address)
        self.decode = DecodeProcess({"protocol": protocol, "layers": layers, "pages": pages_total,
                                     "aux_slots": aux_slots, "head_dim": head_dim})
        self.next_room = 1
        self.clock = _StageClock(self.mgr)
        _freeze_heap()

    def rooms(self, src: list[list[int]], dst: list[list[int]], want: list[int]) -> dict:
        """One set of rooms sent at once; timestamps of the set (the stages when it is one room)."""
        from splitserve.transfer import KVSender

        ids = list(range(self.next_room, self.next_room + len(src)))
        self.next_room += len(src)
        self.finals.watch(ids)
        writes, write_cpu = self.clock.writes, self.clock.write_cpu_s
        copier0 = dict(self.clock.copier_s)
        # The prefill's CPU from its rooms' creation, through their metadata's arrival, to the last Success.
        cpu0 = time.process_time()  # every thread of this process, Mooncake's too
        threads0 = python_threads_cpu()
        senders = [KVSender(self.mgr, self.server.address, i) for i in ids]
        for k, (sender, pages) in enumerate(zip(senders, src, strict=True)):
            sender.init(len(pages), k % self.aux.shape[0])
        self.decode.ask(self.server.address, ids, dst)
        _wait_all(self.mgr, senders, lambda s: s.poll() != KVPoll.Bootstrapping, 60)
        time.sleep(0.002)  # a fresh peer's handshake write (first room only) is out of the way
        self.clock.marks = {}
        write_cpu_sent = self.clock.write_cpu_s
        threads_sent = python_threads_cpu()
        cpu_sent = time.process_time()
        t0, send_cpu0 = time.perf_counter(), time.thread_time()
        for sender, pages in zip(senders, src, strict=True):
            sender.send(pages, True)
        t_sent, send_cpu = time.perf_counter(), time.thread_time() - send_cpu0
        t_sender = self.finals.wait(120)
        cpu = time.process_time() - cpu0
        threads_cpu, control_thread_cpu = cpu_since(threads0)
        control_cpu = threads_cpu - (self.clock.write_cpu_s - write_cpu)
        cpu_from_send = time.process_time() - cpu_sent
        control_cpu_from_send = cpu_since(threads_sent)[0] - (self.clock.write_cpu_s - write_cpu_sent)
        answer = self.decode.read(120)
        errors = [s.failure_exception() for s in senders if s.poll() != KVPoll.Success]
        self.dst_layout = next(iter(senders[0]._dsts.values())).layout  # the decode's, from its metadata
        for sender in senders:
            sender.clear()
        if errors or any(s != KVPoll.Success for s in answer["states"]):
            raise RuntimeError(f"rooms failed: {errors[:3]} / {answer['errors']}")
        if answer["checksums"] != want:
            raise RuntimeError("the decode's pages differ from the prefill's")
        return {"t0": t0, "sent": t_sent, "sender_success": t_sender, "decode_success": answer["done_at"],
                "cpu_s": cpu, "control_cpu_s": control_cpu, "cpu_from_send_s": cpu_from_send,
                "control_cpu_from_send_s": control_cpu_from_send, "send_calls_cpu_s": send_cpu,
                "control_thread_cpu_s": control_thread_cpu, "writes": self.clock.writes - writes,
                "copier_s": {k: v - copier0[k] for k, v in self.clock.copier_s.items()}, **self.clock.marks}

    def measure(self, tokens: int, name: str, src_pages: list[int], dst_pages: list[int], repeats: int) -> dict:
        import numpy as np

        from splitserve.transfer.kv.plan import page_segments

        want = [page_checksum(self.pool, src_pages)]
        self.rooms([src_pages], [dst_pages], want)  # warm-up: the first room maps the decode's pool
        self.clock.stages = True
        try:
            marks = [self.rooms([src_pages], [dst_pages], want) for _ in range(repeats)]
        finally:
            self.clock.stages = False

        def med(a: str, b: str) -> float:
            return statistics.median(m[b] - m[a] for m in marks)

        stages = {"send_call": med("t0", "sent"), "to_worker": med("sent", "job"), "plan": med("job", "write"),
                  "write": med("write", "write_end"), "bookkeeping": med("write_end", "sender_success"),
                  "to_decode": med("sender_success", "decode_success")}
        room_s, sender_room_s = med("t0", "decode_success"), med("t0", "sender_success")
        nbytes = len(src_pages) * self.page_bytes
        row = {"tokens": tokens, "pages": name, "bytes": nbytes, "room_ms": room_s * 1e3,
               "prefill_cpu_ms": statistics.median(m["cpu_s"] for m in marks) * 1e3,
               "control_cpu_ms": min(m["control_cpu_s"] for m in marks) * 1e3,
               "control_thread_cpu_ms": min(m["control_thread_cpu_s"] for m in marks) * 1e3,
               "sender_room_ms": sender_room_s * 1e3, "stages_ms": {k: v * 1e3 for k, v in stages.items()}}
        copy_s = device_copy_s(nbytes, repeats, self.device)
        row.update(copy_ms=copy_s * 1e3, device_copy_gbps=nbytes / copy_s / 1e9, room_gbps=nbytes / room_s / 1e9,
                   room_over_copy=copy_s / room_s, sender_room_over_copy=copy_s / sender_room_s)
        if self.protocol == "cuda_ipc":
            dst_session = self.dst_layout.session
            segs = page_segments(self.mgr.layout, self.dst_layout, np.array(src_pages), np.array(dst_pages), 0, 0,
                                 HEADS)
            if segs.nbytes != nbytes:
                raise RuntimeError(f"planned {segs.nbytes} bytes, expected {nbytes}")
            copier = self.mgr.engine.copier
            copier.timed = True
            row.update(segments=len(segs))

            def timed_write(label: str, call: Callable[[], None]) -> None:
                kernels: list[float] = []

                def write() -> None:
                    call()
                    kernels.append(copier.last_kernel_s)

                write_s = _median_s(write, repeats)
                kernel_s = statistics.median(kernels[1:])
                row.update({f"{label}write_ms": write_s * 1e3, f"{label}kernel_ms": kernel_s * 1e3,
                            f"{label}kernel_over_copy": copy_s / kernel_s, f"{label}write_over_copy": copy_s / write_s})

            # The segment table (one row per page run per buffer), then page runs expanded by the kernel (what
            # rooms use where the engine has write_pages), with each of the copier's waits.
            timed_write("segments_", lambda: self.clock.engine_write(dst_session, segs.srcs, segs.dsts, segs.lens))
            if hasattr(self.mgr.engine, "write_pages"):
                from splitserve.transfer.kv.plan import EMPTY, PageCopy, plan_page_runs

                runs = plan_page_runs([PageCopy(self.mgr.layout, self.dst_layout, np.array(src_pages),
                                                np.array(dst_pages), EMPTY)])
                row.update(runs=len(runs.lens))
                wait = copier.wait
                for mode in ("poll", "block"):
                    copier.wait = mode
                    copier._free.clear()  # staging buffers carry an event of their wait's kind
                    timed_write(f"runs_{mode}_", lambda: self.clock.engine_write_pages(dst_session, runs))
                copier.wait = wait
                copier._free.clear()
            copier.timed = False
            # The old keys (the rows before page runs): the write rooms use.
            label = "runs_" + copier.wait + "_" if "runs" in row else "segments_"
            row.update(write_ms=row[label + "write_ms"], kernel_ms=row[label + "kernel_ms"],
                       kernel_over_copy=row[label + "kernel_over_copy"],
                       ipc_write_over_copy=row[label + "write_over_copy"])
            if tokens == self.sweep_tokens and name == "contiguous":
                row["kernel_sweep"] = self.sweep(dst_session, segs, copy_s)
        return row

    def concurrent(self, tokens: int, count: int, name: str, pages_total: int, repeats: int) -> dict:
        """``count`` rooms of ``tokens`` sent at once; from the first send to the decode's last Success."""
        import numpy as np

        n = tokens // PAGE
        rng = np.random.default_rng(tokens * count)
        order = (np.arange(1, pages_total) if name == "contiguous" else rng.permutation(np.arange(1, pages_total)))
        src = [order[i * n:(i + 1) * n].tolist() for i in range(count)]
        dst_order = (np.arange(1, pages_total) if name == "contiguous" else rng.permutation(np.arange(1, pages_total)))
        dst = [dst_order[i * n:(i + 1) * n].tolist() for i in range(count)]
        want = [page_checksum(self.pool, p) for p in src]
        copier = getattr(self.mgr.engine, "copier", None)
        if copier is not None:
            copier.timed = True  # the kernels' device time, summed per set (one lane: one copy at a time)
        try:
            runs = [self.rooms(src, dst, want) for _ in range(repeats)]
        finally:
            if copier is not None:
                copier.timed = False
        nbytes = count * n * self.page_bytes
        total_s = statistics.median(m["decode_success"] - m["t0"] for m in runs)
        sender_s = statistics.median(m["sender_success"] - m["t0"] for m in runs)
        send_calls_s = statistics.median(m["sent"] - m["t0"] for m in runs)
        cpu_s = statistics.median(m["cpu_s"] for m in runs)
        control_cpu_s = min(m["control_cpu_s"] for m in runs)  # CPU time grows under contention: the least
        thread_cpu_s = min(m["control_thread_cpu_s"] for m in runs)
        writes = statistics.median(m["writes"] for m in runs)
        copy_s = device_copy_s(nbytes // count, 3, self.device, back_to_back=count)
        return {"tokens": tokens, "rooms": count, "pages": name, "lanes": self.mgr.workers.per_peer,
                "bytes": nbytes, "total_ms": total_s * 1e3, "sender_ms": sender_s * 1e3,
                "send_calls_ms": send_calls_s * 1e3, "per_room_us": total_s / count * 1e6,
                "prefill_cpu_us_per_room": cpu_s / count * 1e6,
                "control_cpu_us_per_room": control_cpu_s / count * 1e6,
                "control_thread_us_per_room": thread_cpu_s / count * 1e6, "rooms_per_write": count / max(writes, 1),
                "copy_ms": copy_s * 1e3, "gbps": nbytes / total_s / 1e9, "device_copy_gbps": nbytes / copy_s / 1e9,
                "over_copy": copy_s / total_s, "sender_over_copy": copy_s / sender_s,
                "repeats_ms": [{"total": (m["decode_success"] - m["t0"]) * 1e3,
                                "send_calls": (m["sent"] - m["t0"]) * 1e3,
                                "send_calls_cpu": m["send_calls_cpu_s"] * 1e3, "writes": m["writes"],
                                "cpu_from_send": m["cpu_from_send_s"] * 1e3} for m in runs],
                "cpu_from_send_us_per_room": statistics.median(m["cpu_from_send_s"] for m in runs) / count * 1e6,
                "control_cpu_from_send_us_per_room": min(m["control_cpu_from_send_s"] for m in runs) / count * 1e6,
                **({} if copier is None else {
                    "copier_ms": {k: statistics.median(m["copier_s"][k] for m in runs) * 1e3
                                  for k in ("host", "wait", "kernel")},
                    "kernel_over_copy": copy_s / max(statistics.median(m["copier_s"]["kernel"] for m in runs), 1e-12)})}

    sweep_tokens = 8192
    SWEEP = ((2048, 4, 8), (1024, 8, 4), (4096, 2, 8), (2048, 8, 8), (1024, 4, 4))

    def sweep(self, session: str, segs, copy_s: float) -> list[dict]:
        """The copy kernel alone at other shapes, on the same segments into the mapped peer pool."""
        from splitserve.transfer.cuda_ipc.segment_copy import CopyShape, SegmentCopier

        local_dsts = self.mgr.engine.mapped_destinations(session, segs.dsts, segs.lens)
        out = []
        for block, iters, warps in self.SWEEP:
            copier = SegmentCopier(self.mgr.engine.device, CopyShape(block, iters, warps), timed=True)
            times = []
            for _ in range(6):
                copier.copy(segs.srcs, local_dsts, segs.lens)
                times.append(copier.last_kernel_s)
            kernel_s = statistics.median(times[1:])
            out.append({"block": block, "iters": iters, "warps": warps, "kernel_ms": kernel_s * 1e3,
                        "kernel_over_copy": copy_s / kernel_s})
        return out

    def close(self) -> None:
        self.decode.close()
        self.mgr.close()
        self.server.stop()


def run(protocol: str, token_counts: Sequence[int], concurrent: Sequence[tuple[int, int]], lanes: Sequence[int],
        layers: int, repeats: int, head_dim: int = HEAD_DIM, merge_writes: bool = False, kernel_sweep: bool = True,
        on_row: Callable[[dict], None] | None = None) -> dict:
    """The report; ``on_row`` gets the report so far after each row (a run cut short keeps what it measured)."""
    import numpy as np

    pages_total = max([2 * (max(token_counts, default=0) // PAGE)] + [t // PAGE * c for t, c in concurrent]) + 1
    aux_slots = max([c for _, c in concurrent] + [4])
    prefill = _Prefill(protocol, layers, pages_total, aux_slots, lanes[0], head_dim, merge_writes)
    if not kernel_sweep:
        prefill.sweep_tokens = -1
    rows, sets = [], []
    report = {"protocol": protocol, "layers": layers, "head_dim": head_dim, "rooms": rows, "concurrent": sets}
    on_row = on_row or (lambda report: None)
    try:
        for tokens in token_counts:
            n = tokens // PAGE
            rng = np.random.default_rng(tokens)
            rows.append(prefill.measure(tokens, "contiguous", list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)),
                                        repeats))
            rows.append(prefill.measure(tokens, "scattered", rng.permutation(np.arange(1, pages_total))[:n].tolist(),
                                        rng.permutation(np.arange(1, pages_total))[:n].tolist(), repeats))
            log.info("%s", rows[-1])
            on_row(report)
        for lane_count in lanes:
            prefill.mgr.workers.per_peer = lane_count  # lanes are made on demand: this sets how many
            for tokens, count in concurrent:
                for name in ("contiguous", "scattered"):
                    prefill.rooms([[1]], [[1]], [page_checksum(prefill.pool, [1])])  # lanes warm
                    sets.append(prefill.concurrent(tokens, count, name, pages_total, max(3, repeats // 2)))
                    log.info("%s", sets[-1])
                    on_row(report)
    finally:
        prefill.close()
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['protocol']}: GB/s = 1e9 bytes/s, each byte counted once; copy = contiguous device copy of "
             "the same bytes; room = sender send to the decode process seeing Success; cpu = the prefill "
             "process's CPU from the rooms' creation to the last Success, ctl = its Python threads' CPU outside the "
             "data path's write calls, thr = its control thread's",
             f"{'tokens':>6} {'pages':<11}{'bytes':>11}{'copy GB/s':>10}{'room GB/s':>10}{'room/copy':>10}"
             f"{'kernel/copy':>12}{'write/copy':>11}{'room ms':>8}{'cpu ms':>7}{'ctl ms':>7}{'thr ms':>7}  stages ms: "
             + " ".join(STAGES)]
    for r in report["rooms"]:
        st = " ".join(f"{r['stages_ms'][k]:.3f}" for k in STAGES)
        kern = f"{r['kernel_over_copy']:.2f}" if "kernel_over_copy" in r else "-"
        wr = f"{r['ipc_write_over_copy']:.2f}" if "ipc_write_over_copy" in r else "-"
        lines.append(f"{r['tokens']:>6} {r['pages']:<11}{r['bytes']:>11}{r['device_copy_gbps']:>10.1f}"
                     f"{r['room_gbps']:>10.1f}{r['room_over_copy']:>10.3f}{kern:>12}{wr:>11}{r['room_ms']:>8.3f}"
                     f"{r['prefill_cpu_ms']:>7.3f}{r['control_cpu_ms']:>7.3f}{r['control_thread_cpu_ms']:>7.3f}  {st}")
        for k in r.get("kernel_sweep", []):
            lines.append(f"    sweep block {k['block']} x{k['iters']} warps {k['warps']}: {k['kernel_ms']:.3f} ms, "
                         f"kernel/copy {k['kernel_over_copy']:.2f}")
    ipc_rows = [r for r in report["rooms"] if "segments_write_ms" in r]
    if ipc_rows:
        lines.append("the write alone (one room's pages, no aux), kernel / copy and write / copy: the segment table, "
                     "page runs with a polled wait, page runs with a blocking wait")
        for r in ipc_rows:
            parts = [f"segments ({r['segments']} rows) {r['segments_kernel_over_copy']:.2f} / "
                     f"{r['segments_write_over_copy']:.2f}"]
            for mode in ("poll", "block"):
                if f"runs_{mode}_write_ms" in r:
                    parts.append(f"runs ({r['runs']}) {mode} {r[f'runs_{mode}_kernel_over_copy']:.2f} / "
                                 f"{r[f'runs_{mode}_write_over_copy']:.2f} ({r[f'runs_{mode}_write_ms']:.3f} ms)")
            lines.append(f"{r['tokens']:>6} {r['pages']:<11}" + "; ".join(parts))
    if report["concurrent"]:
        lines.append("rooms in flight at once: first send to the decode's last Success, against as many back-to-back "
                     "device copies of one room's bytes")
        lines.append(f"{'tokens':>6} {'rooms':>5} {'pages':<11}{'lanes':>5}{'total ms':>9}{'us/room':>8}{'GB/s':>8}"
                     f"{'copy GB/s':>10}{'/copy':>7}{'sender/copy':>12}{'send calls ms':>14}{'cpu us/room':>12}"
                     f"{'ctl us/room':>12}{'thr us/room':>12}{'rooms/write':>12}")
        for c in report["concurrent"]:
            lines.append(f"{c['tokens']:>6} {c['rooms']:>5} {c['pages']:<11}{c['lanes']:>5}{c['total_ms']:>9.2f}"
                         f"{c['per_room_us']:>8.0f}{c['gbps']:>8.1f}{c['device_copy_gbps']:>10.1f}{c['over_copy']:>7.3f}"
                         f"{c['sender_over_copy']:>12.3f}{c['send_calls_ms']:>14.2f}"
                         f"{c['prefill_cpu_us_per_room']:>12.0f}{c['control_cpu_us_per_room']:>12.0f}"
                         f"{c['control_thread_us_per_room']:>12.0f}"
                         f"{c['rooms_per_write']:>12.1f}")
        lines.append("the same sets from the first send: prefill CPU us/room (process; Python outside the write "
                     "calls), the copier's host part / wait / kernel ms per set, kernel / copy")
        for c in report["concurrent"]:
            if "cpu_from_send_us_per_room" in c:
                cm = c.get("copier_ms", {"host": 0.0, "wait": 0.0, "kernel": 0.0})
                lines.append(f"{c['tokens']:>6} {c['rooms']:>5} {c['pages']:<11} "
                             f"cpu {c['cpu_from_send_us_per_room']:.0f}, "
                             f"ctl {c['control_cpu_from_send_us_per_room']:.0f}; copier {cm['host']:.2f} / "
                             f"{cm['wait']:.2f} / {cm['kernel']:.2f} ms; "
                             f"kernel/copy {c.get('kernel_over_copy', 0.0):.2f}")
    return "\n".join(lines)


log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark and prints the table; ``--json PATH`` also writes the report."""
    parser = argparse.ArgumentParser(prog="splitserve bench --profile transfer --transfer-protocol cuda_ipc",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfer-protocol", choices=["cuda_ipc", "tcp"], default="cuda_ipc",
                        help="cuda_ipc (a GPU), or tcp: the same rooms over Mooncake TCP in host memory")
    parser.add_argument("--kv-tokens", type=lambda s: [int(x) for x in s.split(",") if x], default=[512, 2048, 8192],
                        help="prompt lengths of the one-room-at-a-time rows (multiples of 16)")
    parser.add_argument("--concurrent", type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",") if x],
                        default=[(512, 256), (2048, 64), (8192, 16)],
                        help="TOKENSxROOMS sets sent at once, comma-separated ('' for none)")
    parser.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[2],
                        help="worker lanes per decode peer (transfer_threads) for the concurrent sets")
    parser.add_argument("--layers", type=int, default=32, help="layers of the KV layout (32: 128 KiB per token)")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM,
                        help="head size of the KV layout (small: the same 2 x layers buffers with few bytes, so the "
                             "prefill's CPU per room shows without the copy; tcp on a CPU box)")
    parser.add_argument("--merge-writes", action="store_true",
                        help="tcp: rooms queued for the decode share one Mooncake write, as cuda_ipc's share a copy")
    parser.add_argument("--no-kernel-sweep", action="store_true",
                        help="skip timing the copy kernel at other block shapes (8,192-token contiguous row)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each measurement (median)")
    parser.add_argument("--json", default="", help="also write the report as JSON to this path")
    parser.add_argument("--decode-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.decode_child:
        _decode_child(json.loads(args.decode_child))
        return 0
    import torch

    if args.transfer_protocol == "cuda_ipc" and not torch.cuda.is_available():
        parser.error("--transfer-protocol cuda_ipc needs a CUDA device")
    logging.basicConfig(level=logging.WARNING)

    def write_json(report: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    def progress(report: dict) -> None:
        write_json(report)
        last = (report["concurrent"] or report["rooms"])[-1]
        print(f"measured: {last['tokens']} tokens x {last.get('rooms', 1)} rooms, {last['pages']}", flush=True)

    report = run(args.transfer_protocol, args.kv_tokens, args.concurrent, args.lanes, args.layers, args.repeats,
                 args.head_dim, args.merge_writes, not args.no_kernel_sweep, progress)
    print(format_report(report))
    write_json(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
