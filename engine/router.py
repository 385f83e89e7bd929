"""`splitserve router`: the OpenAI-compatible front door of a deployment.

Disaggregated (`--prefill URL... --decode URL...`): for each request pick the prefill and the
decode with the fewest outstanding requests, draw a random 63-bit bootstrap room, and send
the request with `bootstrap_host/port/room` to both at once; decode's answer (streamed or
not) goes back to the client. If the prefill fails before the first token (nothing has been
sent to the client yet), the pair is abandoned and the request is retried once on another
prefill with a new room. Unified (`--unified URL...`): least-loaded proxying to data-parallel
replicas. A client that disconnects closes the upstream streams, so the engines abort and
free the request's pages.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.config_flags import ConfigError, add_config_flags, config_from_args
from splitserve.engine.openai_protocol import ApiError
from splitserve.engine.server import error_response, read_json, wait_for_disconnect
from splitserve.transfer.bootstrap_grant import SIGNATURE_FIELD, sign_bootstrap

logger = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """Where the engines are and how to reach them."""

    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    prefill: list[str] = field(default_factory=list, metadata={"help": "prefill engine URLs"})
    decode: list[str] = field(default_factory=list, metadata={"help": "decode engine URLs"})
    unified: list[str] = field(default_factory=list, metadata={"help": "unified engine URLs (data parallel)"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "upstream request timeout"})
    prefill_retries: int = field(default=1, metadata={"help": "retries on another prefill before the first token"})
    transfer_control_key: str = field(default="", metadata={
        "help": "the group's key (the engines' --transfer-control-key): signs each pair's bootstrap fields "
                "(bootstrap_signature); empty: unsigned, for engines without a key"})

    def __post_init__(self) -> None:
        if self.unified and (self.prefill or self.decode):
            raise ValueError("give either --unified URLs or --prefill and --decode URLs, not both")
        if not self.unified and not (self.prefill and self.decode):
            raise ValueError("need --prefill and --decode URLs (or --unified URLs)")


class UpstreamError(Exception):
    """An engine answered with an error or could not be reached."""

    def __init__(self, url: str, status: int, body: Any) -> None:
        super().__init__(f"{url} answered {status}: {body}")
        self.url, self.status, self.body = url, status, body


@dataclass(eq=False)
class Backend:
    """One engine behind the router, with its outstanding-request count."""

    url: str
    outstanding: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


def least_loaded(backends: list[Backend], exclude: set[str] = frozenset()) -> Backend:  # type: ignore[assignment]
    candidates = [b for b in backends if b.url not in exclude] or backends
    return min(candidates, key=lambda b: b.outstanding)


class Router:
    """Routes OpenAI requests to prefill+decode pairs or unified replicas."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.prefill = [Backend(u.rstrip("/")) for u in cfg.prefill]
        self.decode = [Backend(u.rstrip("/")) for u in cfg.decode]
        self.unified = [Backend(u.rstrip("/")) for u in cfg.unified]
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_router_requests", "Requests routed", ["outcome"], registry=self.registry)
        self.retries = Counter("splitserve_router_prefill_retries", "Retries on another prefill",
                               registry=self.registry)
        self.in_flight = Gauge("splitserve_router_requests_in_flight", "Requests in flight", registry=self.registry)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={ApiError: lambda _r, e: error_response(e)}, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await asyncio.gather(*(self._health_of(b) for b in self.prefill))  # learn the bootstrap ports
        yield
        await self.client.aclose()

    @property
    def backends(self) -> list[Backend]:
        return self.prefill + self.decode + self.unified

    # ---- endpoints ---------------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        return await self._route(request, "/v1/completions")

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._route(request, "/v1/chat/completions")

    async def models(self, _request: HttpRequest) -> Response:
        backend = (self.decode or self.unified)[0]
        try:
            r = await self.client.get(f"{backend.url}/v1/models")
        except httpx.HTTPError as exc:
            return JSONResponse(ApiError(f"engine {backend.url} unreachable: {exc}", status=503,
                                         kind="server_error").body(), status_code=503)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def health(self, _request: HttpRequest) -> Response:
        states = await asyncio.gather(*(self._health_of(b) for b in self.backends))
        unhealthy = [b.url for b, ok in zip(self.backends, states, strict=True) if not ok]
        status = 200 if not unhealthy else 503
        return JSONResponse({"status": "ok" if not unhealthy else "degraded", "unhealthy": unhealthy},
                            status_code=status)

    async def metrics(self, _request: HttpRequest) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _health_of(self, backend: Backend) -> bool:
        try:
            r = await self.client.get(f"{backend.url}/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        info = r.json()
        if info.get("bootstrap_port") is not None:
            backend.bootstrap_host, backend.bootstrap_port = info["bootstrap_host"], int(info["bootstrap_port"])
        return True

    # ---- routing -----------------------------------------------------------------------------

    async def _route(self, request: HttpRequest, path: str) -> Response:
        """Routes one request; a client that leaves before the answer cancels the upstream calls
        (closing their connections, so the engines abort the request and free its pages)."""
        body = await read_json(request)
        self.in_flight.inc()  # until the answer starts (a stream's tokens then flow on their own)
        work = asyncio.ensure_future(self._route_body(request, path, body))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            self.requests.labels("client_gone").inc()
            return Response(status_code=499)
        finally:
            gone.cancel()
            self.in_flight.dec()

    async def _route_body(self, request: HttpRequest, path: str, body: Any) -> Response:
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        stream = body.get("stream") is True
        if self.unified:
            backend = least_loaded(self.unified)
            return await self._forward(request, backend, path, body, stream)
        return await self._disaggregated(request, path, body, stream)

    async def _forward(self, request: HttpRequest, backend: Backend, path: str, body: dict, stream: bool,
                       upstream: httpx.Response | None = None) -> Response:
        """Relays one engine's answer (already opened as `upstream`, or opened here)."""
        backend.outstanding += 1
        try:
            if upstream is None:
                upstream = await self._open(backend, path, body)
        except UpstreamError as exc:
            backend.outstanding -= 1
            self.requests.labels("error").inc()
            return JSONResponse(ApiError(str(exc), status=503, kind="server_error").body(), status_code=503)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()  # closing the upstream makes the engine abort the request
                backend.outstanding -= 1
        headers = {"content-type": upstream.headers.get("content-type", "application/json")}
        self.requests.labels("ok" if upstream.status_code == 200 else "error").inc()
        if stream and upstream.status_code == 200:
            return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
            backend.outstanding -= 1
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _open(self, backend: Backend, path: str, body: dict) -> httpx.Response:
        try:
            req = self.client.build_request("POST", f"{backend.url}{path}", json=body)
            return await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(backend.url, 0, repr(exc)) from exc

    async def _disaggregated(self, request: HttpRequest, path: str, body: dict, stream: bool) -> Response:
        check_single_sequence(body)
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for attempt in range(1 + max(0, self.cfg.prefill_retries)):
            prefill = least_loaded(self.prefill, exclude=tried)
            decode = least_loaded(self.decode)
            tried.add(prefill.url)
            if prefill.bootstrap_port is None and not await self._health_of(prefill):
                last_error = UpstreamError(prefill.url, 0, "prefill not healthy (no bootstrap port)")
                continue
            pair_body = pair_request(body, prefill.bootstrap_host, prefill.bootstrap_port, secrets.randbits(63),
                                     self.cfg.transfer_control_key)
            if attempt:
                self.retries.inc()
                logger.warning("retrying request on prefill %s after: %s", prefill.url, last_error)
            outcome = await self._try_pair(prefill, decode, path, pair_body, stream)
            if isinstance(outcome, httpx.Response):
                return await self._forward(request, decode, path, pair_body, stream, upstream=outcome)
            last_error = outcome
            if outcome.status and 400 <= outcome.status < 500:
                break  # the client's fault: another prefill would say the same
        self.requests.labels("error").inc()
        assert last_error is not None
        if last_error.status and 400 <= last_error.status < 500:
            return Response(json.dumps(last_error.body).encode(), status_code=last_error.status,
                            media_type="application/json")
        return JSONResponse(ApiError(f"request failed: {last_error}", status=503, kind="server_error").body(),
                            status_code=503)

    async def _try_pair(self, prefill: Backend, decode: Backend, path: str, body: dict, stream: bool
                        ) -> httpx.Response | UpstreamError:
        """Sends to both; returns decode's open response once prefill succeeded, else prefill's error.

        The decode's response is opened at once (it only starts answering after its KV has
        landed). The prefill's outcome decides: on failure the decode stream is closed, which
        aborts its receiver and frees its pages.
        """
        prefill.outstanding += 1
        decode_task = asyncio.ensure_future(self._open(decode, path, body))
        try:
            prefill_body = {**body, "stream": False}
            prefill_body.pop("stream_options", None)
            try:
                r = await self.client.post(f"{prefill.url}{path}", json=prefill_body)
                prefill_error = None if r.status_code == 200 else UpstreamError(prefill.url, r.status_code,
                                                                                 _json_or_text(r))
            except httpx.HTTPError as exc:
                prefill_error = UpstreamError(prefill.url, 0, repr(exc))
        except asyncio.CancelledError:  # the client left: drop decode's side too
            await _abandon(decode_task)
            raise
        finally:
            prefill.outstanding -= 1
        if prefill_error is None:
            try:
                return await decode_task
            except UpstreamError as exc:
                return exc
        await _abandon(decode_task)  # decode's receiver is aborted when its connection closes
        return prefill_error


async def _abandon(task: asyncio.Future) -> None:
    """Cancels an upstream call, closing its response if it had already opened."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, UpstreamError):
        resp = await task
        await resp.aclose()


def pair_request(body: dict, host: str, port: int, room: int, key: str) -> dict:
    """The body both engines of a pair get: the request plus where they meet (the prefill's
    bootstrap server and a room), signed with the group's key so the engines know the router
    chose it."""
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if key:
        fields[SIGNATURE_FIELD] = sign_bootstrap(key, host, port, room)
    return {**body, **fields}


def check_single_sequence(body: dict) -> None:
    """One room carries one sequence: n > 1 and batched prompts are refused, not silently split."""
    if body.get("n", 1) != 1:
        raise ApiError("'n' > 1 is not supported by a disaggregated deployment; send n requests", "n")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        if len(prompt) > 1:
            raise ApiError("batched prompts are not supported by a disaggregated deployment; send one prompt "
                           "per request", "prompt")
        body["prompt"] = prompt[0]


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:500]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, RouterConfig, "SPLITSERVE_ROUTER")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(RouterConfig, args, "SPLITSERVE_ROUTER")
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    router = Router(cfg)
    logger.info("router on http://%s:%d: prefill %s, decode %s, unified %s", cfg.host, cfg.port, cfg.prefill,
                cfg.decode, cfg.unified)
    uvicorn.run(router.app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
