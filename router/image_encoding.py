"""Encoder disaggregation at the router: each image of a chat request goes to an encode engine
before the prefill+decode pair is chosen.

Per image part: its bytes (a data: URL decoded, an http(s) URL fetched with the router's limits),
a random 63-bit room, and an encoder picked by a hash of the bytes (the same image meets the same
encoder and its cache; an encoder that fails is skipped for the next in the ring). The encoders
decode and check the images first, so a bad one is a 400 naming its part before any prefill
work. The part is then rewritten into an `image_ref` (the image's hash, the encoder's embedding
endpoint and the room): the pixels never travel to prefill or decode. Text-only requests, and
deployments without encoders, pass through unchanged.

The encoders an attempt used are handed back with the body: the attempt watches them like its
prefill and decode, so an encoder that dies before its rows landed (e.g. mid-write) ends the
attempt as soon as the router sees it gone, and the retry encodes again on a live encoder.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.api.openai_protocol import ApiError, ImagePart
from splitserve.engine.multimodal.image_inputs import ImageInputConfig, check_image_count, image_bytes
from splitserve.router.backend_pool import Backend, BackendPool
from splitserve.transfer.bootstrap_grant import KEY_HEADER

logger = logging.getLogger(__name__)


class EncodersUnavailable(Exception):
    """No encoder could take an image (every one tried failed or none is healthy)."""


@dataclass
class Prepared:
    """The body prefill and decode get, and the encoders its image rows come from."""

    body: Any
    encoders: list[Backend]


@dataclass
class ImageSlot:
    """One image part of the request and where its rows will come from."""

    message: int
    part: int
    where: str
    url: str  # a data: URL goes to the encoder as it came; a fetched image as a data: URL of its bytes
    data: bytes
    digest: str
    room: int = 0
    encoder: Backend | None = None
    endpoint: str = ""
    grid: list[int] | None = None  # Qwen-VL: the image's patch grid, from the encoder's answer


def image_parts(body: dict) -> list[tuple[int, int, str, str]]:
    """(message index, part index, where, url) of every image_url part, in prompt order."""
    out = []
    for i, m in enumerate(body.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                out.append((i, j, f"messages[{i}].content[{j}]", url if isinstance(url, str) else ""))
    return out


def sniff_mime(data: bytes) -> str:
    """The image type its first bytes say; anything else is sent as PNG and fails to decode there (400)."""
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


def encoder_ring(encoders: list[Backend], digest: str) -> list[Backend]:
    """The encoders in the order an image tries them: a start chosen by its hash, then the ring."""
    ordered = sorted(encoders, key=lambda b: b.url)
    start = int(digest[:16], 16) % len(ordered)
    return ordered[start:] + ordered[:start]


class ImageEncoding:
    """Sends a request's images to encoders and rewrites the request for prefill and decode."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, images: ImageInputConfig,
                 control_key: str = "", backend_wait_s: float = 0.0) -> None:
        self.pool, self.client, self.images, self.backend_wait_s = pool, client, images, backend_wait_s
        self.headers = {KEY_HEADER: control_key} if control_key else {}  # encoders of a keyed group ask for it

    async def prepare(self, body: Any) -> Prepared:
        """The request for prefill and decode: images replaced by references to their encoders' rows."""
        if not isinstance(body, dict) or not self.pool.backends("encode"):
            return Prepared(body, [])
        found = image_parts(body)
        if not found:
            return Prepared(body, [])
        parts = [ImagePart(where, url=url) for _, _, where, url in found]
        check_image_count(parts, self.images)
        slots = []
        async with httpx.AsyncClient(timeout=self.images.image_fetch_timeout) as fetcher:
            for (i, j, where, _), part in zip(found, parts, strict=True):
                if not part.url:
                    raise ApiError(f"{where}: an image_url part needs 'image_url': {{'url': ...}}", where,
                                   code="invalid_image")
                data = await image_bytes(part, self.images, fetcher)
                url = part.url if part.url.startswith("data:") else \
                    f"data:{sniff_mime(data)};base64," + base64.b64encode(data).decode()
                slots.append(ImageSlot(i, j, where, url, data, hashlib.sha256(data).hexdigest()))
        failed: dict[Backend, int] = {}  # encoders ejected for a call: not again, unless admitted again since
        pending = list(slots)
        called: set[str] = set()  # encoders whose calls failed
        calls = 3  # rounds of encode calls: the first and two retries (a suspect that passes its probe is retried)
        loop = asyncio.get_running_loop()
        wait_until: float | None = None  # for an encoder when none is healthy: set the first time
        while pending:
            never = self.pool.still_failed(failed)
            healthy = [b for b in self.pool.backends("encode") if b.routable and b.url not in never]
            if not healthy:
                wait_until = loop.time() + self.backend_wait_s if wait_until is None else wait_until
                if await self.pool.wait_for_backend("encode", wait_until):  # a verdict, a restart, a new one
                    continue
                raise EncodersUnavailable(
                    f"no encoder could take the images: none is healthy; waited {self.backend_wait_s:g} s for one "
                    f"(--backend-wait-s)" + (f"; their encode calls had failed on {sorted(called)}" if called else ""))
            if not calls:
                raise EncodersUnavailable(f"the images' encode calls failed 3 times (on {sorted(called)})")
            calls -= 1
            groups: dict[str, list[ImageSlot]] = {}
            for slot in pending:
                slot.encoder, slot.room = encoder_ring(healthy, slot.digest)[0], secrets.randbits(63)
                groups.setdefault(slot.encoder.url, []).append(slot)
            results = await asyncio.gather(*(self._encode(g) for g in groups.values()))
            pending = [s for group, ok in zip(groups.values(), results, strict=True) if not ok for s in group]
            called |= {s.encoder.url for s in pending if s.encoder}
            failed |= {s.encoder: s.encoder.admissions for s in pending if s.encoder and not s.encoder.healthy}
        used = {id(s.encoder): s.encoder for s in slots if s.encoder is not None}
        return Prepared(rewritten(body, slots), list(used.values()))

    async def _encode(self, group: list[ImageSlot]) -> bool:
        """Posts one encoder's items; False if the encoder failed (it is ejected or probed; try another)."""
        backend = group[0].encoder
        assert backend is not None
        items = [{"room": s.room, "where": s.where, "image_url": {"url": s.url}} for s in group]
        call = asyncio.ensure_future(self.client.post(f"{backend.url}/v1/encode", json={"items": items},
                                                      headers=self.headers))
        ejected = asyncio.ensure_future(backend.ejected.wait())
        try:
            # An encoder that stops answering (frozen, partitioned) keeps its socket open, so the
            # call would wait for the read timeout; its ejection (failed health probes) ends the wait.
            await asyncio.wait({call, ejected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ejected.cancel()
        if not call.done():
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await call
            logger.warning("encode call to %s abandoned: the encoder was ejected (%s)", backend.url,
                           backend.last_error)
            return False  # try another encoder
        try:
            r = call.result()
        except httpx.HTTPError as exc:
            self.pool.report_failure(backend, f"encode call: {type(exc).__name__}: {exc}")
            return False
        if r.status_code == 400:
            err = r.json().get("error", {})
            raise ApiError(err.get("message", "bad image"), err.get("param"), code=err.get("code"))
        if r.status_code != 200:
            self.pool.report_failure(backend, f"encode call answered {r.status_code}: {r.text[:200]}")
            return False
        answer = r.json()
        for slot, item in zip(group, answer["items"], strict=True):
            slot.endpoint = answer["endpoint"]
            slot.digest = item["digest"]
            slot.grid = item.get("grid")
        return True


def rewritten(body: dict, slots: list[ImageSlot]) -> dict:
    """A copy of `body` whose image parts are `image_ref` parts (pure)."""
    messages = [dict(m) if isinstance(m, dict) else m for m in body["messages"]]
    for slot in slots:
        content = list(messages[slot.message]["content"])
        ref: dict[str, Any] = {"digest": slot.digest, "encoder_addr": slot.endpoint, "room": slot.room}
        if slot.grid is not None:
            ref["grid"] = slot.grid
        content[slot.part] = {"type": "image_ref", "image_ref": ref}
        messages[slot.message]["content"] = content
    return {**body, "messages": messages}
