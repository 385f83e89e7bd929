"""Which backend moves KV, by ``--transfer-protocol``: Mooncake (``rdma``, ``tcp``) or CUDA IPC (``cuda_ipc``).

The engine builds its manager with ``new_kv_manager`` and its aux tensor on ``aux_device``;
senders and receivers (``KVSender``, ``KVReceiver``) are the same for every backend.
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer.config import TransferConfig
from splitserve.transfer.kv.layout import KVLayout
from splitserve.transfer.kv.manager import KVManager


def new_kv_manager(config: TransferConfig, layout: KVLayout, *,
                   metrics_registry: CollectorRegistry | None = None) -> KVManager:
    """The manager of ``config.transfer_protocol``'s backend."""
    if config.transfer_protocol == "cuda_ipc":
        from splitserve.transfer.cuda_ipc.manager import CudaIpcKVManager

        return CudaIpcKVManager(config, layout, metrics_registry=metrics_registry)
    return KVManager(config, layout, metrics_registry=metrics_registry)


def aux_device(config: TransferConfig, pool_device: torch.device) -> torch.device:
    """Where the aux slots live: beside the KV for CUDA IPC (it copies device memory only), else on the host."""
    return pool_device if config.transfer_protocol == "cuda_ipc" else torch.device("cpu")
