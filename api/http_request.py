"""Reading an HTTP request, shared by the engine's API and the router (which must not import torch):
the JSON body with its limits, the client's disconnect, and ApiError as a response."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from splitserve.api.openai_protocol import ApiError

MAX_BODY_BYTES = 32 << 20


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def route_error_response(request: HttpRequest, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no such path) and 405 (a method the path does not take) as OpenAI-style
    JSON errors, like every other error of the API (its default answers them in plain text)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    where = f"{request.method} {request.url.path}"
    if status == 404:
        err = ApiError(f"Invalid URL ({where}): no such endpoint", status=404, code="not_found")
    elif status == 405:
        allowed = headers.get("allow") or headers.get("Allow") or ""
        err = ApiError(f"Method not allowed ({where})" + (f"; this endpoint takes {allowed}" if allowed else ""),
                       status=405, code="method_not_allowed", headers=headers)
    else:
        detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
        err = ApiError(f"{detail} ({where})", status=status, code=None, headers=headers)
    return error_response(err)


ROUTE_ERROR_HANDLERS = {404: route_error_response, 405: route_error_response}


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
