"""The encode role: the vision tower + projector and an embedding sender, nothing else.

The router posts each image item with its room to `/v1/encode`; the image is decoded and
preprocessed there (a bad one is a 400 before any engine work), its room is opened on the sender
(`begin`) and the item queued. The loop encodes queued items in batches on the loop thread (the
only thread that runs the model) into slots of the sender's registered pool, which double as an
LRU cache by image hash: a hit ships at once. The rows go to the prefill rank once it asks for
the room; a slot stays pinned until its transfer concluded.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.engine.engine import Engine
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.image_inputs import ImageInputConfig, load_images
from splitserve.engine.image_processor import ClipImageProcessor
from splitserve.engine.openai_protocol import ApiError, ImagePart
from splitserve.engine.role import Role
from splitserve.engine.roles.embedding_cache import EmbeddingCache
from splitserve.transfer import TransferConfig
from splitserve.transfer.bootstrap_grant import KEY_HEADER
from splitserve.transfer.embedding_sender import EmbeddingChunk, EmbeddingSender
from splitserve.transfer.embedding_slots import EmbeddingSlots

logger = logging.getLogger(__name__)


@dataclass
class EncodeJob:
    room: int
    digest: str
    pixels: torch.Tensor


def parse_encode_items(body: Any) -> list[tuple[int, ImagePart]]:
    """`{"items": [{"room": int, "image_url": {"url": ...}, "where": str?}]}` -> (room, part) pairs."""
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise ApiError("'items' must be a non-empty array of {room, image_url}", "items")
    out = []
    for i, item in enumerate(items):
        room = item.get("room") if isinstance(item, dict) else None
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
            raise ApiError(f"'items[{i}].room' must be an integer in [0, 2^63)", f"items[{i}]")
        spec = item.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        where = item.get("where") if isinstance(item.get("where"), str) else f"items[{i}]"
        if not isinstance(url, str) or not url:
            raise ApiError(f"{where}: an item needs 'image_url': {{'url': ...}}", where, code="invalid_image")
        out.append((room, ImagePart(where, url=url)))
    return out


class EncodeRole(Role):
    """Encode: vision tower + projector, an embedding sender and the embedding cache."""

    name = "encode"

    def __init__(self, transfer: TransferConfig, epd: EPDConfig, images: ImageInputConfig) -> None:
        self.transfer = transfer
        self.epd = epd
        self.images = images
        self.jobs: collections.deque[EncodeJob] = collections.deque()

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        vision = engine.model_cfg.vision
        if vision is None:
            raise ValueError(f"--role encode needs a multimodal model; {engine.cfg.model} takes no images")
        self.vision = vision
        self.processor = ClipImageProcessor.from_folder(engine.model_folder)
        self.slots = EmbeddingSlots(self.epd.encode_cache_size, vision.tokens_per_image, engine.model_cfg.hidden_size,
                                    engine.runner.dtype)
        self.sender = EmbeddingSender(self.transfer, self.slots, engine.metrics.registry,
                                     pause_halfway_s=self.epd.embedding_write_pause_s)
        self.cache = EmbeddingCache(self.epd.encode_cache_size)
        self.dtype_name = str(engine.runner.dtype).removeprefix("torch.")
        logger.info("encode role: embedding endpoint %s, cache of %d images", self.sender.endpoint,
                    self.epd.encode_cache_size)

    def routes(self) -> list[Route]:
        return [Route("/v1/encode", self.encode_endpoint, methods=["POST"])]

    def health_info(self) -> dict[str, Any]:
        return {"embedding_endpoint": self.sender.endpoint,
                "embedding": {"cached_images": len(self.cache), "pinned_slots": self.cache.pinned,
                              "queued": len(self.jobs), **self.sender.stats()}}

    async def encode_endpoint(self, request: HttpRequest) -> Response:
        key = self.transfer.transfer_control_key
        if key and not hmac.compare_digest(request.headers.get(KEY_HEADER, ""), key):
            # Only the group's router may hand this encoder work: each call costs a tower forward.
            err = ApiError(f"missing or wrong {KEY_HEADER}", status=401, kind="authentication_error")
            return JSONResponse(err.body(), status_code=401)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(ApiError("request body is not valid JSON").body(), status_code=400)
        try:
            pairs = parse_encode_items(body)
            loaded = await load_images([p for _, p in pairs], self.images)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        pixels = await asyncio.to_thread(lambda: [self.processor(img.image) for img in loaded])
        accepted = []
        for (room, _), img, px in zip(pairs, loaded, pixels, strict=True):
            if not self.sender.begin(room):
                return JSONResponse(ApiError(f"room {room} is already open on this encoder", "items",
                                             status=409).body(), status_code=409)
            accepted.append(EncodeJob(room, img.digest, px))
            # The loop thread takes the jobs; call_soon wakes it.
        self.engine.call_soon(lambda: self.jobs.extend(accepted))
        return JSONResponse({"endpoint": self.sender.endpoint, "items": [
            {"room": j.room, "digest": j.digest, "rows": self.vision.tokens_per_image} for j in accepted]})

    def poll(self) -> None:
        for done in self.sender.concluded():
            if done.slot is not None:
                self.cache.unpin(done.slot)
        if self.jobs:
            self._run_jobs()

    def _run_jobs(self) -> None:
        misses: list[tuple[EncodeJob, int]] = []
        computing: dict[str, int] = {}
        waiting: list[EncodeJob] = []
        while self.jobs and len(misses) < self.epd.encode_batch_size:
            job = self.jobs.popleft()
            slot = self.cache.lookup(job.digest)
            if slot is not None:
                self.sender.metrics.cache_hits_total.inc()
                self._ship(job, slot)
            elif job.digest in computing:  # the same image twice in one batch: encode it once
                waiting.append(job)
            else:
                slot = self.cache.reserve()
                if slot is None:  # every slot is being read by a transfer: try next turn
                    self.jobs.appendleft(job)
                    break
                misses.append((job, slot))
                computing[job.digest] = slot
        if misses:
            started = time.monotonic()
            try:
                rows = self.engine.runner.encode_images([j.pixels for j, _ in misses])
            except Exception as exc:  # a bug or an OOM: these items fail, the engine keeps serving
                logger.exception("encoding %d images failed", len(misses))
                for job, slot in misses:
                    self.cache.unpin(slot)
                    self.cache.discard(slot)
                    self.sender.fail(job.room, f"encoding failed: {exc}")
                for job in waiting:
                    self.sender.fail(job.room, f"encoding failed: {exc}")
                return
            self.sender.metrics.encode_seconds.observe(time.monotonic() - started)
            for (job, slot), r in zip(misses, rows, strict=True):
                self.slots.buffer[slot, : r.shape[0]] = r.to(self.slots.buffer)
                self.cache.insert(job.digest, slot)
                self.sender.metrics.cache_misses_total.inc()
                self._ship(job, slot)
            for job in waiting:
                slot = self.cache.lookup(job.digest)
                assert slot is not None
                self.sender.metrics.cache_hits_total.inc()
                self._ship(job, slot)

    def _ship(self, job: EncodeJob, slot: int) -> None:
        rows = self.vision.tokens_per_image
        taken = self.sender.send(EmbeddingChunk(job.room, slot, rows, self.slots.hidden, self.dtype_name,
                                                rows * self.slots.hidden * self.slots.buffer.element_size()))
        if not taken:  # the room failed or was aborted meanwhile
            self.cache.unpin(slot)

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.jobs or self.cache.pinned else None

    def close(self) -> None:
        self.sender.close()
