"""`POST /internal/role`: switches a prefill engine to decode or back without reloading its weights.

Body: `{"role": "prefill" | "decode", "group": <the group's key>, "settle_s": 2.0, "timeout_s": 300}`.
Authenticated like every /internal endpoint (the group's key in the key header); `group`, when given,
must be that key too (a caller that meant another group's engine is told so). The answer, once the
switch is done: `{"from_role", "to_role", "switched", "drain_s", "swap_s", "total_s"}` (`switched` is
false, and nothing happened, when the engine already has the role). Errors: 400 for a role that is not
prefill or decode; 409 for an engine that cannot switch (unified, encode, drafter, tensor-parallel) and while
another switch runs; 503 when the drain did not
end in `timeout_s` (the engine keeps its role and serves again). See engine/role_switch.py.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.api.http_request import read_json
from splitserve.api.openai_protocol import ApiError
from splitserve.engine.role_switch import RoleSwitchRefused

if TYPE_CHECKING:
    from splitserve.api.core_client import CoreClient
    from splitserve.api.engine_client import EngineClient

DEFAULT_SETTLE_S = 2.0  # above the router's default probe interval (1 s): every router sees the drain
DEFAULT_TIMEOUT_S = 300.0


def _seconds(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ApiError(f"'{name}' must be a number of seconds >= 0, got {value!r}", name)
    return float(value)


def role_route(client: EngineClient | CoreClient, control_key: str,
               check_key: Callable[[HttpRequest], None]) -> Route:
    """The route, for the engine behind `client`; `check_key` authenticates like the other /internal routes."""

    async def switch_role(request: HttpRequest) -> Response:
        check_key(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        group = body.get("group")
        if group is not None and not (isinstance(group, str) and hmac.compare_digest(group, control_key)):
            raise ApiError("'group' is not this engine's group key: this engine belongs to another group", "group",
                           status=403, kind="permission_error", code="wrong_group")
        settle_s = _seconds(body, "settle_s", DEFAULT_SETTLE_S)
        timeout_s = _seconds(body, "timeout_s", DEFAULT_TIMEOUT_S)
        if timeout_s < settle_s:
            raise ApiError(f"'timeout_s' ({timeout_s:g}) must be at least 'settle_s' ({settle_s:g})", "timeout_s")
        switch = client.role_switch
        if switch is None:
            raise ApiError(f"this {client.role_name} engine cannot switch roles", "role", status=409,
                           code="role_not_switchable")
        try:
            result = await switch.switch(body.get("role"), settle_s, timeout_s)
        except RoleSwitchRefused as exc:
            raise ApiError(str(exc), "role", status=exc.status,
                           kind="invalid_request_error" if exc.status < 500 else "server_error",
                           code=exc.code) from None
        return JSONResponse(result.as_dict())

    return Route("/internal/role", switch_role, methods=["POST"])
