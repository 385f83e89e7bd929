"""The encode role: the vision tower + projector and an embedding sender, nothing else.

The router posts each image item with its room to `/v1/encode` (api/encode_endpoint.py: the
image is decoded and preprocessed there, a bad one is a 400 before any engine work); `accept`
opens the call's rooms on the sender (`begin_all`: all, or none and a 409) and queues the items;
`close_call` closes them again when the call fails before its answer reached the router (its
client left, the core answered too late). With `serve --engine-process` the API server process
does the HTTP side and the core's `accept` and `close_call` are reached over the wire (`core_calls`).
The loop encodes queued items in batches on the loop thread (the only thread that runs the model)
into slots of the sender's registered pool, which double as an LRU cache by image hash: a hit
ships at once. The rows go to the prefill rank once it asks for the room; a slot stays pinned
until its transfer concluded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from starlette.routing import Route

from splitserve.api.encode_endpoint import EncodeCall, EncodeJob, encode_route, room_taken
from splitserve.engine.engine import Engine
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.multimodal.image_inputs import ImageInputConfig
from splitserve.engine.multimodal.prompt_images import image_processor_for, max_image_tokens
from splitserve.engine.multimodal.qwen_vl_config import QwenVisionConfig
from splitserve.engine.role import Role
from splitserve.engine.roles.embedding_cache import EmbeddingCache
from splitserve.transfer import TransferConfig
from splitserve.transfer.embedding.sender import EmbeddingChunk, EmbeddingSender
from splitserve.transfer.embedding.slots import EmbeddingSlots

logger = logging.getLogger(__name__)


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
        self.processor = image_processor_for(vision, engine.model_folder)
        # A slot holds the largest image's rows (Qwen-VL: at the processor's max_pixels).
        self.slots = EmbeddingSlots(self.epd.encode_cache_size, max_image_tokens(vision, self.processor),
                                    engine.model_cfg.hidden_size, engine.runner.dtype)
        self.sender = EmbeddingSender(self.transfer, self.slots, engine.metrics.registry,
                                     pause_halfway_s=self.epd.embedding_write_pause_s)
        self.cache = EmbeddingCache(self.epd.encode_cache_size)
        self.dtype_name = str(engine.runner.dtype).removeprefix("torch.")
        logger.info("encode role: embedding endpoint %s, cache of %d images", self.sender.endpoint,
                    self.epd.encode_cache_size)

    def routes(self) -> list[Route]:
        async def accept(call: EncodeCall) -> tuple[int, dict[str, Any]]:
            answer = self.accept(call)
            await asyncio.sleep(self.epd.encode_answer_delay_s)  # tests only: a late answer (0 in production)
            return answer
        return [encode_route(self.transfer.transfer_control_key, self.images, self.processor, self.vision, accept,
                             lambda call: self.close_call(call.key, call.rooms))]

    def core_calls(self) -> dict[str, Any]:
        from splitserve.api.core_protocol import encode_call_from_wire

        def encode(arg: list[Any]) -> list[Any]:
            answer = list(self.accept(encode_call_from_wire(arg)))
            time.sleep(self.epd.encode_answer_delay_s)  # tests only: the core's late answer (0 in production)
            return answer
        return {"encode": encode, "encode_close": lambda arg: len(self.close_call(arg[0], arg[1]))}

    def serves_structured_outputs(self) -> bool:
        """An encode pod runs the vision tower for the router's encode calls, never a client's generation: no
        grammar compiler at start (one is still built on first use if a request brought a grammar)."""
        return False

    def health_info(self) -> dict[str, Any]:
        return {"embedding_endpoint": self.sender.endpoint,
                "embedding": {"cached_images": len(self.cache), "pinned_slots": self.cache.pinned,
                              "queued": len(self.jobs), **self.sender.stats()}}

    def accept(self, call: EncodeCall) -> tuple[int, dict[str, Any]]:
        """Opens every job's room (or none: 409) and queues the jobs for the loop thread (any thread may call it):
        (HTTP status, body) for /v1/encode."""
        taken = self.sender.begin_all(call.rooms, owner=call.key)  # all or none: a 409 leaves no room open
        if taken is not None:
            return room_taken(taken)
        try:
            self.engine.call_soon(lambda: self.jobs.extend(call.jobs))  # the loop thread takes them; call_soon wakes it
        except BaseException:  # the engine is gone: nothing will take the jobs, nothing may hold their rooms
            self.sender.close_rooms(call.key, call.rooms, "the encode engine could not take the call")
            raise
        return 200, {"endpoint": self.sender.endpoint, "items": [
            {"room": j.room, "digest": j.digest, "rows": self.rows(j)} | ({"grid": list(j.grid)} if j.grid else {})
            for j in call.jobs]}

    def rows(self, job: EncodeJob) -> int:
        """The image's embedding rows: LLaVA's fixed count, a Qwen-VL image's from its grid."""
        if isinstance(self.vision, QwenVisionConfig):
            assert job.grid is not None, "a Qwen-VL encode job carries its grid"
            return self.vision.tokens_for_grid(job.grid)
        return self.vision.tokens_per_image

    def close_call(self, key: int, rooms: list[int]) -> list[int]:
        """The call `key` failed before its answer reached the router: its rooms still open close now
        (their queued jobs are dropped, their slots unpinned) rather than at the bootstrap timeout."""
        closed = self.sender.close_rooms(key, rooms, "its /v1/encode call failed before the router had the answer")
        if closed:
            logger.info("closed %d room(s) of the failed /v1/encode call %d", len(closed), key)
            gone = set(closed)
            # On the loop thread, after the call's own `extend` (call_soon keeps the order).
            self.engine.call_soon(lambda: self._drop_jobs(gone))
        return closed

    def _drop_jobs(self, rooms: set[int]) -> None:
        kept = [job for job in self.jobs if job.room not in rooms]
        self.jobs.clear()
        self.jobs.extend(kept)

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
                rows = self.engine.runner.encode_images([j.pixels for j, _ in misses], [j.grid for j, _ in misses])
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
        rows = self.rows(job)
        taken = self.sender.send(EmbeddingChunk(job.room, slot, rows, self.slots.hidden, self.dtype_name,
                                                rows * self.slots.hidden * self.slots.buffer.element_size()))
        if not taken:  # the room failed or was aborted meanwhile
            self.cache.unpin(slot)

    def idle_poll_interval(self) -> float | None:
        return 0.002 if self.jobs or self.cache.pinned else None

    def close(self) -> None:
        self.sender.close()
