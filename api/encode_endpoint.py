"""`/v1/encode`'s HTTP side: the group's key, the items, the images decoded and preprocessed (a bad
one is a 400 before any engine work); the call's jobs then go to `accept`: the encode role in this
process, or, with `serve --engine-process`, the engine core process's over the wire.

A call that fails once its rooms may be open (the client left before the answer, the core's answer
came too late, any answer but 200) goes to `close`, which closes the rooms that call opened: no
prefill will ask for them, and each would hold its room and slot until the bootstrap timeout. Each
call has a key of its own, which its rooms carry, so closing a refused call never closes another's.

`{"items": [{"room": int, "image_url": {"url": ...}, "where": str?}]}` is answered with the encoder's
embedding endpoint and each item's room, digest and rows, or 409 when a room is already open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.api.http_request import wait_for_disconnect
from splitserve.api.openai_protocol import ApiError, ImagePart
from splitserve.engine.multimodal.image_inputs import ImageInputConfig, load_images
from splitserve.engine.multimodal.prompt_images import ImageProcessor, max_image_tokens, preprocess
from splitserve.engine.multimodal.qwen_vl_config import QwenVisionConfig
from splitserve.engine.multimodal.vision_config import VisionConfig
from splitserve.transfer.bootstrap_grant import KEY_HEADER

logger = logging.getLogger(__name__)


@dataclass
class EncodeJob:
    """One image to encode and ship to the prefill that asks for `room`."""

    room: int
    digest: str
    pixels: torch.Tensor
    grid: tuple[int, int, int] | None = None  # Qwen-VL: the patch grid of `pixels` (its patches)


@dataclass
class EncodeCall:
    """One /v1/encode call: its jobs, and its key (unique in this server process), which marks the
    rooms the call opens as its own."""

    key: int
    jobs: list[EncodeJob]

    @property
    def rooms(self) -> list[int]:
        return [job.room for job in self.jobs]


# Takes one call's jobs, opening their rooms; answers (HTTP status, JSON body).
AcceptCall = Callable[[EncodeCall], Awaitable[tuple[int, dict[str, Any]]]]
# Closes the rooms a failed call opened (none if it opened none); must not block.
CloseCall = Callable[[EncodeCall], None]


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


def encode_route(control_key: str, images: ImageInputConfig, processor: ImageProcessor,
                 vision: VisionConfig | QwenVisionConfig, accept: AcceptCall, close: CloseCall) -> Route:
    """The `/v1/encode` route: checks and preprocesses here, then hands the call to `accept`, and
    to `close` if it fails."""
    keys = itertools.count()
    max_rows = max_image_tokens(vision, processor)

    async def endpoint(request: HttpRequest) -> Response:
        if control_key and not hmac.compare_digest(request.headers.get(KEY_HEADER, ""), control_key):
            # Only the group's router may hand this encoder work: each call costs a tower forward.
            err = ApiError(f"missing or wrong {KEY_HEADER}", status=401, kind="authentication_error")
            return JSONResponse(err.body(), status_code=401)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(ApiError("request body is not valid JSON").body(), status_code=400)
        try:
            pairs = parse_encode_items(body)
            loaded = await load_images([p for _, p in pairs], images)
            items = await asyncio.to_thread(lambda: [preprocess(processor, vision, img) for img in loaded])
            for it, img in zip(items, loaded, strict=True):
                if it.num_tokens > max_rows:  # an extreme aspect ratio: more rows than an embedding slot holds
                    raise ApiError(f"{img.part.where}: the image becomes {it.num_tokens} tokens; an encoder's slots "
                                   f"hold {max_rows}", img.part.where, code="image_too_large")
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        jobs = [EncodeJob(room, it.digest, it.pixels, it.grid)  # type: ignore[arg-type]
                for (room, _), it in zip(pairs, items, strict=True)]
        return await answer_or_close(request, EncodeCall(next(keys), jobs), accept, close)

    return Route("/v1/encode", endpoint, methods=["POST"])


async def answer_or_close(request: HttpRequest, call: EncodeCall, accept: AcceptCall, close: CloseCall) -> Response:
    """`accept`'s answer, or 499 once the client has left; every outcome but a 200 answered to a
    client still connected closes the call's rooms (an error or a cancellation here too). A client
    that leaves while the 200 is being written is not seen: its rooms wait for the bootstrap timeout."""
    work = asyncio.ensure_future(accept(call))
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    answered = False
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            logger.info("/v1/encode call %d: the client left before its answer; closing its rooms", call.key)
            return Response(status_code=499)
        status, body = work.result()
        answered = status == 200
        return JSONResponse(body, status_code=status)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work  # its own cleanup (the core's reply forgotten) runs before the close
        if not answered:
            close(call)


def room_taken(room: int) -> tuple[int, dict[str, Any]]:
    """The answer when a job's room is already open on the encoder."""
    return 409, ApiError(f"room {room} is already open on this encoder", "items", status=409).body()
