"""Prefill's embedding receiver: a request whose images an encode engine computes waits here, out
of the scheduler, until every item's rows landed; the rows are copied into the items (the runner
writes them into the prompt's embeddings) and the slots released, then the request is scheduled.

A failed item fails its request (the KV sender behaviour then tells the waiting decode); a
request whose rows did not arrive in time fails with a timeout (the API answers 408).
"""

from __future__ import annotations

import logging
from typing import Any

from splitserve.engine.engine import Engine
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.multimodal.image_items import EMBEDDING_TIMEOUT
from splitserve.engine.multimodal.prompt_images import image_processor_for, max_image_tokens
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import Role
from splitserve.transfer import TransferConfig
from splitserve.transfer.embedding.receiver import EmbeddingReceiver, WantedItem
from splitserve.transfer.embedding.slots import EmbeddingSlots

logger = logging.getLogger(__name__)


HANDED_OVER = "embedding_receiver"  # its name among what a role hands over on a switch (engine/role.py)


class EmbeddingReceivingRole(Role):
    """Holds requests with encoder-computed images until their rows are in."""

    name = "embedding-receiver"
    hands_over = HANDED_OVER

    def __init__(self, transfer: TransferConfig, epd: EPDConfig) -> None:
        self.transfer = transfer
        self.epd = epd
        self.waiting: dict[str, Request] = {}

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        if self.taken_over is not None:  # its slots and Mooncake engine as they were
            self.receiver, self.slots = self.taken_over, self.taken_over.slots
            return
        vision = engine.model_cfg.vision
        assert vision is not None, "the embedding receiver is only built for multimodal models"
        rows = max_image_tokens(vision, image_processor_for(vision, engine.model_folder))
        self.slots = EmbeddingSlots(self.epd.embedding_slots, rows, engine.model_cfg.hidden_size, engine.runner.dtype)
        self.receiver = EmbeddingReceiver(self.transfer, self.slots, self.epd.embedding_timeout_s,
                                          engine.metrics.registry)

    def on_arrival(self, req: Request) -> bool:
        remote = [item for item in req.images if item.embedding is None and item.pixels is None]
        if not remote:
            return False  # text only, or images this engine encodes itself
        if any(item.room is None or item.encoder_addr is None for item in remote):
            self.engine.finish(req, FinishReason.ERROR, "an image without pixels needs an encoder and a room")
            return True
        self.receiver.stage(req.request_id, [WantedItem(i.room, i.encoder_addr, i.num_tokens, i.digest)
                                             for i in remote])  # type: ignore[arg-type]
        self.waiting[req.request_id] = req
        return True

    def poll(self) -> None:
        if not self.waiting:
            return
        landed, failed = self.receiver.settle(self.receiver.poll())
        for rid, slots in landed:
            req = self.waiting.pop(rid)
            remote = [item for item in req.images if item.embedding is None and item.pixels is None]
            for item, slot in zip(remote, slots, strict=True):
                item.embedding = self.slots.rows(slot, item.num_tokens).to(self.engine.runner.device, copy=True)
            self.receiver.release(slots)
            self.engine.scheduler.add(req)
        for rid, reason in failed:
            req = self.waiting.pop(rid)
            error = f"{EMBEDDING_TIMEOUT}: {reason}" if "timed out" in reason else f"image embedding failed: {reason}"
            self.engine.finish(req, FinishReason.ERROR, error)

    def on_finish(self, req: Request) -> None:
        if self.waiting.pop(req.request_id, None) is not None:
            self.receiver.drop(req.request_id, f"request ended: {req.error or 'aborted'}")

    def health_info(self) -> dict[str, Any]:
        return {"embedding_receiver": self.receiver.endpoint,
                "embedding": {"waiting": len(self.waiting), **self.receiver.stats()}}

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.waiting else None

    def close(self) -> None:
        self.receiver.close()

    def hand_over(self) -> dict[str, Any]:
        return {HANDED_OVER: self.receiver}
