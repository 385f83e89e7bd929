"""What prefill and decode both need to move KV: the aux slots, the layout and the manager."""

from __future__ import annotations

import logging

from splitserve.engine.engine import Engine
from splitserve.transfer import KVManager, TransferConfig, layout_for_pool, make_aux_tensor

logger = logging.getLogger(__name__)


class KVTransferEndpoint:
    """Registers an engine's KV pool and one aux slot per request slot with the transfer layer."""

    def __init__(self, engine: Engine, config: TransferConfig) -> None:
        pool = engine.runner.kv_pool.buffer
        # Aux slots are indexed by the request's slot, like every other per-request row.
        self.aux = make_aux_tensor(engine.cfg.max_running_requests)
        if pool.device.type != "cpu" and config.transfer_protocol == "tcp":
            logger.warning("KV pool on %s with the tcp transport: Mooncake TCP stages GPU memory through "
                           "the host; use rdma in production", pool.device)
        layout = layout_for_pool(pool, self.aux, tp_size=engine.runner.tp.size, tp_rank=engine.runner.tp.rank,
                                 num_kv_heads=engine.model_cfg.num_kv_heads)
        self.manager = KVManager(config, layout, metrics_registry=engine.metrics.registry)

    def close(self) -> None:
        self.manager.close()
