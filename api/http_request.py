"""Reading an HTTP request, shared by the engine's API and the router (which must not import torch):
the JSON body with its limits, the client's disconnect, and ApiError as a response."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from splitserve.api.openai_protocol import ApiError

MAX_BODY_BYTES = 32 << 20


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_json(request: HttpRequest) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    raw = await request.body()
    if not raw:
        raise ApiError("request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from None


async def wait_for_disconnect(request: HttpRequest) -> None:
    """Returns when the client closes the connection (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
