"""Rank 0's side of tensor parallelism: start the worker processes, wait until they are ready,
notice when one dies, and stop them.

Rank 0 is the engine process (scheduler, KV bookkeeping, HTTP, sampling). It hosts the TCP
store the ranks meet at, spawns ranks 1..N-1 (engine/tp/worker.py), and installs a
`StepBroadcaster` on its ModelRunner, so every forward pass is announced to the workers first.
A worker that exits is seen by `check()` (the engine loop calls it every iteration); the engine
then fails its requests and reports unhealthy instead of waiting on a collective forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import time
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from splitserve.engine.config import EngineConfig
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel, join_tensor_parallel
from splitserve.engine.tp.step_broadcast import StepBroadcaster
from splitserve.engine.tp.worker import (
    KV_LAYOUT_KEY,
    READY_OK,
    KVLayoutMessage,
    WorkerSpec,
    joined_key,
    ready_key,
    worker_device,
    worker_main,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05
MAX_PING_INTERVAL_S = 10.0
STOP_GRACE_S = 10.0


class TensorParallelStartupError(RuntimeError):
    """A worker died, failed or did not answer in time while the ranks were starting."""


def parse_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host, int(port)


class TensorParallelSupervisor:
    """Owns rank 0's store and process groups and the worker processes of ranks 1..N-1."""

    def __init__(self, cfg: EngineConfig, model_folder: Path) -> None:
        self.cfg = cfg
        self.size = cfg.tp_size
        self.model_folder = model_folder
        self.timeout_s = cfg.tp_timeout
        self.startup_timeout_s = cfg.tp_startup_timeout
        self.ping_interval_s = min(MAX_PING_INTERVAL_S, self.timeout_s / 4)
        self.workers: dict[int, BaseProcess] = {}
        self.tp: TensorParallel = SINGLE
        self.broadcaster: StepBroadcaster | None = None
        self.failure: str | None = None
        self._store: dist.TCPStore | None = None

    # ---- startup ----------------------------------------------------------------------------

    def start(self) -> TensorParallel:
        """Spawns the workers and joins the process groups with them; returns rank 0's view."""
        host, port = parse_host_port(self.cfg.dist_init_addr) if self.cfg.dist_init_addr else ("127.0.0.1", 0)
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.startup_timeout_s))
        port = self._store.port
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        for rank in range(1, self.size):
            spec = WorkerSpec(cfg=dataclasses.replace(self.cfg, device=worker_device(self.cfg, rank)),
                              model_folder=self.model_folder, rank=rank, size=self.size, store_host=host,
                              store_port=port, timeout_s=self.timeout_s, startup_timeout_s=self.startup_timeout_s)
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"splitserve-tp{rank}", daemon=True)
            proc.start()
            self.workers[rank] = proc
        logger.info("tensor parallel: started %d workers (pids %s), store at %s:%d", self.size - 1,
                    [p.pid for p in self.workers.values()], host, port)
        self._wait_for_key(joined_key, "join the process group")
        self.tp, control = join_tensor_parallel(0, self.size, self._store, self.cfg.torch_device(),
                                                timedelta(seconds=self.timeout_s))
        self.broadcaster = StepBroadcaster(control)
        return self.tp

    def attach(self, runner: ModelRunner, page_table: torch.Tensor, padding_slot: int) -> None:
        """Sends rank 0's KV layout, waits until every worker holds its shard, then has the
        runner announce every forward pass. Call it before capturing CUDA graphs: the workers
        capture theirs as soon as they are ready, and the captures' collectives must pair up."""
        if self._store is None or self.broadcaster is None:
            raise RuntimeError("attach() before start()")
        layout = KVLayoutMessage(runner.kv_shape.num_pages, tuple(page_table.shape), padding_slot)
        self._store.set(KV_LAYOUT_KEY, layout.encode())
        self._wait_for_key(ready_key, "load its shard of the model")
        for rank in self.workers:
            answer = self._store.get(ready_key(rank)).decode()
            if answer != READY_OK:
                raise TensorParallelStartupError(f"tensor-parallel rank {rank} failed to start: {answer}")
        runner.step_broadcaster = self.broadcaster
        logger.info("tensor parallel: %d ranks ready", self.size)

    def _wait_for_key(self, key_of, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        missing = set(self.workers)
        while missing:
            for rank in sorted(missing):
                if self._store.check([key_of(rank)]):
                    missing.discard(rank)
                    continue
                proc = self.workers[rank]
                if proc.exitcode is not None:
                    raise TensorParallelStartupError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                        f"before it could {what}; its log lines start with 'tp{rank}'")
            if missing and time.monotonic() > deadline:
                raise TensorParallelStartupError(
                    f"tensor-parallel ranks {sorted(missing)} did not {what} within "
                    f"--tp-startup-timeout {self.startup_timeout_s:.0f} s")
            if missing:
                time.sleep(POLL_S)

    # ---- while serving (the engine loop's thread) -------------------------------------------

    def lost_worker(self, wait_s: float = 0.0) -> str | None:
        """Why the group cannot run steps any more (a worker exited), or None; `wait_s` gives a
        worker whose connection just broke time to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.workers.items():
                if proc.exitcode is not None:
                    return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                            "this engine cannot run the model any more")
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def check(self) -> str | None:
        """Called every loop iteration: returns the failure, if any; sends queued role
        operations, or pings idle workers."""
        if self.failure is None:
            self.failure = self.lost_worker()
        if self.failure is not None or self.broadcaster is None:
            return self.failure
        try:
            if self.broadcaster.pending_ops:  # a role's transfer calls, for the other ranks to repeat
                self.broadcaster.send_ops()
            elif time.monotonic() - self.broadcaster.last_sent > self.ping_interval_s:
                self.broadcaster.ping()
        except RuntimeError as exc:
            self.collective_failed(exc)
        return self.failure

    def collective_failed(self, exc: Exception) -> str:
        """Records that a collective outside a step broke (e.g. a transfer poll agreement); the
        engine loop fails the engine on its next `check()`. Returns the reason."""
        if self.failure is None:
            self.failure = self.lost_worker(wait_s=1.0) or f"tensor-parallel ranks stopped answering: {exc}"
        return self.failure

    def pids(self) -> dict[int, int | None]:
        return {rank: proc.pid for rank, proc in self.workers.items()}

    # ---- shutdown ---------------------------------------------------------------------------

    def stop(self, graceful: bool = True) -> None:
        """Tells healthy workers to stop (if `graceful`: nothing else is using the process groups),
        then makes sure every worker process is gone."""
        if graceful and self.broadcaster is not None and self.failure is None and self.lost_worker() is None:
            try:
                self.broadcaster.stop()
            except RuntimeError as exc:
                logger.warning("could not tell the tensor-parallel workers to stop: %s", exc)
        for rank, proc in self.workers.items():
            proc.join(timeout=STOP_GRACE_S)
            if proc.exitcode is None:
                logger.warning("tensor-parallel rank %d did not stop; terminating it", rank)
                proc.terminate()
                proc.join(timeout=STOP_GRACE_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        if dist.is_initialized() and dist.get_backend() != "nccl":
            with contextlib.suppress(RuntimeError):
                dist.destroy_process_group()
        # NCCL groups are left to the process's exit: on 2 H200s, destroying one whose all-reduces
        # were captured in CUDA graphs hung on every rank (workers do not destroy theirs either).
        self.broadcaster = None
        self._store = None
