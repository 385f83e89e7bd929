"""A tensor-parallel worker (rank 1..N-1): holds its shard of the model and its heads' KV, and
runs every forward pass rank 0 tells it to. It schedules, samples and serves nothing itself.

Startup, in step with rank 0 (engine/tp/supervisor.py), over rank 0's TCP store:
1. set `joined/<rank>`, join the process groups;
2. build its own ModelRunner (sharded weights), in parallel with the other ranks;
3. read rank 0's KV layout (page count, page-table shape), so that page numbers mean the same
   pages on every rank;
4. set `ready/<rank>` ("ok", or the error that stopped it), capture decode CUDA graphs in step
   with rank 0 (GPU only), then loop on step messages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_pool import COPY_PAGE_OP, KVPool
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.tp.parallel_state import TensorParallel, join_tensor_parallel
from splitserve.engine.tp.step_broadcast import OPS, PING, POLL, STEP, STOP, receive_step

logger = logging.getLogger(__name__)

KEY_PREFIX = "splitserve/tp/"
READY_OK = "ok"


def joined_key(rank: int) -> str:
    return f"{KEY_PREFIX}joined/{rank}"


def ready_key(rank: int) -> str:
    return f"{KEY_PREFIX}ready/{rank}"


KV_LAYOUT_KEY = f"{KEY_PREFIX}kv_layout"


@dataclass(frozen=True)
class KVLayoutMessage:
    """What rank 0 tells the workers about its KV cache, as JSON in the store."""

    num_pages: int
    page_table_shape: tuple[int, int]
    padding_slot: int

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> KVLayoutMessage:
        d = json.loads(raw)
        return cls(int(d["num_pages"]), tuple(d["page_table_shape"]), int(d["padding_slot"]))


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, picklable for the spawn start method."""

    cfg: EngineConfig  # already pointing at this rank's device
    model_folder: Path
    rank: int
    size: int
    store_host: str
    store_port: int
    timeout_s: float  # every collective's limit
    startup_timeout_s: float  # how long to wait for rank 0's page count


def worker_device(cfg: EngineConfig, rank: int) -> str:
    """Rank r runs on the r-th GPU after rank 0's (cuda:0 -> cuda:r); every rank on CPU otherwise."""
    device = cfg.torch_device()
    if device.type != "cuda":
        return str(device)
    return f"cuda:{(device.index or 0) + rank}"


def resize_kv_pool(runner: ModelRunner, num_pages: int) -> None:
    """Makes the runner's pool exactly rank 0's size (each rank sizes it from its own free memory)."""
    if runner.kv_shape.num_pages == num_pages:
        return
    logger.info("KV pool: %d pages here, %d on rank 0; using rank 0's count", runner.kv_shape.num_pages, num_pages)
    scales = runner.kv_pool.scales  # an FP8 pool's (the checkpoint's, or 1.0): the new pool reads pages alike
    e4m3_prompts = runner.kv_pool.e4m3_prompts  # and its prompts attend as rank 0's do
    del runner.kv_pool
    runner.kv_shape = dataclasses.replace(runner.kv_shape, num_pages=num_pages)
    runner.kv_pool = KVPool(runner.kv_shape, runner.device)
    runner.kv_pool.e4m3_prompts = e4m3_prompts
    if scales is not None:
        runner.kv_pool.set_scales(scales)


def run_steps(runner: ModelRunner, tp: TensorParallel, control: dist.ProcessGroup,
              page_table: torch.Tensor) -> None:
    """Runs rank 0's steps (and, on prefill/decode, repeats its transfer calls) until it says stop."""
    steps = 0
    persistent = {"page_table": page_table}
    transfers = None
    try:
        with torch.inference_mode():
            while True:
                msg = receive_step(control, runner.device, persistent)
                role_ops = []
                for op in msg.ops:
                    if op[0] == COPY_PAGE_OP:  # rank 0 copied a KV page: so does this rank, before the step
                        runner.kv_pool.copy_page(op[1], op[2])
                    elif op[0] == "setup":
                        from splitserve.engine.roles.rank_transfers import RankTransfers  # imports Mooncake
                        _, role, transfer_config, bootstrap_addr = op
                        transfers = RankTransfers(runner, tp, role, transfer_config, bootstrap_addr)
                    else:
                        role_ops.append(op)
                if role_ops or msg.kind == POLL:
                    if transfers is None:
                        raise ValueError(f"rank 0 sent transfer work ({msg.kind}) before setting transfers up")
                    transfers.apply(role_ops)
                if msg.kind == STEP:
                    runner.forward(msg.batch)
                    steps += 1
                elif msg.kind == POLL:
                    transfers.agree(msg.payload, control)
                elif msg.kind == STOP:
                    logger.info("stop from rank 0 after %d steps", steps)
                    return
                elif msg.kind not in (PING, OPS):
                    raise ValueError(f"unknown step message kind {msg.kind!r} from rank 0")
    finally:
        if transfers is not None:
            transfers.close()


def worker_main(spec: WorkerSpec) -> None:
    """The worker process's entry point. Exits non-zero on any error, which rank 0 notices.

    If rank 0 dies, the worker's pending receive fails (gloo sees the closed connection, or the
    collective times out) and the worker exits too.
    """
    logging.basicConfig(level=spec.cfg.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp{spec.rank} %(name)s: %(message)s")
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                          timeout=timedelta(seconds=spec.startup_timeout_s))
    store.set(joined_key(spec.rank), "1")
    try:
        tp, control = join_tensor_parallel(spec.rank, spec.size, store, spec.cfg.torch_device(), timeout)
        try:
            model_cfg = ModelConfig.from_checkpoint(spec.model_folder)
            runner = ModelRunner(spec.cfg, spec.model_folder, model_cfg, tp)
            layout = KVLayoutMessage.decode(store.get(KV_LAYOUT_KEY))
            resize_kv_pool(runner, layout.num_pages)
            # This rank's copy of rank 0's request-to-page table, refreshed by every decode step.
            page_table = torch.zeros(layout.page_table_shape, dtype=torch.int32, device=runner.device)
        except Exception as exc:
            store.set(ready_key(spec.rank), f"{type(exc).__name__}: {exc}")
            raise
        store.set(ready_key(spec.rank), READY_OK)
        logger.info("tensor-parallel rank %d/%d ready on %s", spec.rank, spec.size, runner.device)
        runner.capture_decode_graphs(page_table, layout.padding_slot)  # rank 0 captures at the same time
        run_steps(runner, tp, control, page_table)
        if dist.get_backend() == "nccl":
            # Destroying NCCL groups whose all-reduces were captured in CUDA graphs hung on 2 H200s:
            # the process exits with them instead (nothing is pending: rank 0 said stop).
            logging.shutdown()
            os._exit(0)
        dist.destroy_process_group()
    except Exception:
        logger.exception("tensor-parallel rank %d stops on an error", spec.rank)
        sys.exit(1)
