"""The router's HTTP app: OpenAI routes, liveness (`/health`), readiness (`/ready`), metrics.

`/health` is liveness: 200 while the router runs, whatever its backends do, with each backend's
state in the body. `/ready` is readiness: 200 while at least one prefill and one decode (or one
unified replica) is healthy, else 503. Admission is bounded: past ``max_in_flight`` requests (those
waiting included) the answer is a 503 with Retry-After at once. When every healthy backend of a role
is at ``max_in_flight_per_backend``, a request waits for a slot in that role's line, first come first
served, up to ``queue_timeout_s``, then gets the 503. When a role has no healthy backend at all (engines
still loading, one restarting after a crash), a request waits up to ``backend_wait_s`` for one, then gets
the 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.api.http_request import ROUTE_ERROR_HANDLERS, error_response, read_json, wait_for_disconnect
from splitserve.api.openai_protocol import ApiError
from splitserve.api.otel import Tracing, otel_endpoint
from splitserve.engine.multimodal.image_inputs import ImageInputConfig
from splitserve.router.api_keys import ApiKeys
from splitserve.router.backend_pool import ROLES, BackendPool, NoBackend, Overloaded
from splitserve.router.cache_routing import CacheAwareRouting, TokenizedPrompt
from splitserve.router.config import RouterConfig
from splitserve.router.endpoints_watch import SERVICE_ACCOUNT_DIR, EndpointsWatch, InClusterAccess
from splitserve.router.fan_out import Sequence, fan_out, split_sequences
from splitserve.router.health_prober import HealthProber
from splitserve.router.image_encoding import EncodersUnavailable, ImageEncoding
from splitserve.router.kv_events import KVEventsPoller
from splitserve.router.pair_routing import Answer, PairRouter, PrefillAffinity
from splitserve.router.phases import PHASES_HEADER, PhaseRecorder, RequestTiming, phases_comment
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.role_changes import with_reported_roles
from splitserve.router.upstream import EJECTING_KINDS, UpstreamClient, UpstreamFailure, sse_error_event

logger = logging.getLogger(__name__)


class RelayResponse(StreamingResponse):
    """A streamed answer whose generator is always closed when the response ends, however it
    ends (a client that leaves mid-stream included), so its leases come back at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Admission:
    """The router-wide in-flight count, one ``release`` per admitted request."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def enter(self) -> Admission.Ticket:
        if self.count >= self.limit:
            raise Overloaded(f"the router has {self.limit} requests in flight")
        return Admission.Ticket(self)

    class Ticket:
        def __init__(self, admission: Admission) -> None:
            self.admission, self.released = admission, False
            admission.count += 1

        def release(self) -> None:
            if not self.released:
                self.released = True
                self.admission.count -= 1


def error_json(message: str, status: int, code: str | None = None, retry_after: int | None = None) -> JSONResponse:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    return JSONResponse(ApiError(message, status=status, kind="server_error", code=code).body(), status_code=status,
                        headers=headers)


class Router:
    """Routes OpenAI requests to prefill+decode pairs or unified replicas.

    ``router.pool.replace(role, urls)`` changes a role's backends at runtime (new ones join once
    a probe passes; those that leave drain), e.g. from a Kubernetes Endpoints watch.
    """

    def __init__(self, cfg: RouterConfig, images: ImageInputConfig | None = None) -> None:
        self.cfg = cfg
        self.pool = BackendPool(cfg.max_in_flight_per_backend, cfg.eject_backoff_s, cfg.eject_backoff_max_s)
        for role in ("prefill", "decode", "unified", "encode"):
            self.pool.replace(role, getattr(cfg, role))
        self.client = UpstreamClient(httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
                                     cfg.upstream_keepalive_expiry_s)
        self.prober = HealthProber(self.pool, self.client, cfg.health_interval_s, cfg.health_timeout_s)
        self.admission = Admission(cfg.max_in_flight)
        self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_router_requests", "Requests routed", ["outcome"], registry=self.registry)
        self.retries = Counter("splitserve_router_retries", "Attempts retried on other backends before the first "
                               "token", registry=self.registry)
        self.in_flight = Gauge("splitserve_router_requests_in_flight", "Requests in flight", registry=self.registry)
        self.queued = Gauge("splitserve_router_queued_requests", "Requests waiting for a slot because every healthy "
                            "backend of the role is full", ["role"], registry=self.registry)
        self.backend_in_flight = Gauge("splitserve_router_backend_in_flight", "Requests in flight per backend",
                                       ["role", "url"], registry=self.registry)
        self.backend_healthy = Gauge("splitserve_router_backend_healthy", "1 while a backend is routable",
                                     ["role", "url"], registry=self.registry)
        self.ejections = Gauge("splitserve_router_backend_ejections", "Times a backend was ejected",
                               ["role", "url"], registry=self.registry)
        self.stale_retries = Gauge("splitserve_router_dead_connection_retries", "Engine calls sent once more on a "
                                   "fresh connection after their pooled one was found closed", registry=self.registry)
        self.images = ImageEncoding(self.pool, self.client, images or ImageInputConfig(), cfg.transfer_control_key,
                                    cfg.backend_wait_s)
        self.kv_events: KVEventsPoller | None = None
        routing: CacheAwareRouting | None = None
        if cfg.routing == "cache-aware":
            index = PrefixIndex(approximate_pages=cfg.approximate_cache_pages)
            cached_role = "prefill" if cfg.disaggregated else "unified"
            self.kv_events = KVEventsPoller(index, self.client, lambda: self.pool.urls(cached_role),
                                            cfg.transfer_control_key, cfg.kv_events_interval_s)
            routing = CacheAwareRouting(index, self.kv_events, cfg.cache_aware_max_load_tokens, self.registry)
        self.routing = routing
        self.pairs = PairRouter(self.pool, self.client, cfg.transfer_control_key, cfg.retries, self.retries.inc,
                                prepare=self.images.prepare,  # images go to encoders, when there are any
                                routing=routing, backend_wait_s=cfg.backend_wait_s,
                                queue_timeout_s=cfg.queue_timeout_s)
        self.api_keys = ApiKeys(cfg.api_key, cfg.api_key_file)
        # Raises TracingUnavailable (at start) when spans are asked for and cannot be made.
        self.tracing = Tracing.from_endpoint(otel_endpoint(cfg.otel_endpoint), "splitserve-router")
        self.phases = PhaseRecorder(self.registry, cfg.disaggregated, self.tracing)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={ApiError: lambda _r, e: error_response(e), **ROUTE_ERROR_HANDLERS},
            lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        await self.prober.probe_due()  # serve knowing who is up (and every prefill's bootstrap port)
        tasks = [asyncio.ensure_future(self.prober.run())]
        if self.kv_events is not None:
            tasks.append(asyncio.ensure_future(self.kv_events.run()))
        if self.cfg.kube_group:
            tasks.append(asyncio.ensure_future(self._watch_endpoints()))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()
        if self.tracing is not None:
            self.tracing.shutdown()

    async def _watch_endpoints(self) -> None:
        """--kube-group: the role Services' Endpoints are the backend sets (scaling never restarts us)."""
        namespace = self.cfg.kube_namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()

        def replace(urls: dict[str, list[str]]) -> None:
            urls = with_reported_roles(urls, self.pool)  # an engine that switched roles stays in its new one
            for role in ("prefill", "decode", "encode"):
                self.pool.replace(role, urls.get(role, []))

        await EndpointsWatch(InClusterAccess.from_pod(), namespace, self.cfg.kube_group, replace).run()

    # ---- endpoints ---------------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        received = time.time()
        self.api_keys.check(request.headers.get("authorization"))
        return await self._route(request, "/v1/completions", received)

    async def chat_completions(self, request: HttpRequest) -> Response:
        received = time.time()
        self.api_keys.check(request.headers.get("authorization"))
        return await self._route(request, "/v1/chat/completions", received)

    async def models(self, request: HttpRequest) -> Response:
        self.api_keys.check(request.headers.get("authorization"))
        role = "decode" if self.cfg.disaggregated else "unified"
        backends = [b for b in self.pool.backends(role) if b.routable]
        if not backends:
            return error_json(f"no healthy {role} backend", 503, retry_after=self.cfg.retry_after_s)
        try:
            r = await self.client.get(f"{backends[0].url}/v1/models")
        except httpx.HTTPError as exc:
            return error_json(f"engine {backends[0].url} unreachable: {exc}", 503)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    def readiness(self) -> tuple[bool, str]:
        """Ready with a healthy prefill and decode (or unified replica); the summary counts every role the
        router has engines for, encoders included (they serve only requests with images)."""
        if self.cfg.disaggregated:
            p, d = self.pool.healthy_count("prefill"), self.pool.healthy_count("decode")
            ready, summary = p >= 1 and d >= 1, f"{p} healthy prefill, {d} healthy decode"
            if self.pool.backends("encode"):
                summary += f", {self.pool.healthy_count('encode')} healthy encode"
            return ready, summary
        u = self.pool.healthy_count("unified")
        return u >= 1, f"{u} healthy unified"

    def role_counts(self) -> dict[str, dict[str, int]]:
        """Per role the router has engines for: how many, how many healthy (routable)."""
        return {role: {"healthy": self.pool.healthy_count(role), "total": len(self.pool.backends(role))}
                for role in ROLES if self.pool.backends(role)}

    async def health(self, _request: HttpRequest) -> Response:
        ready, summary = self.readiness()
        return JSONResponse({"status": "ok", "ready": ready, "summary": summary, "roles": self.role_counts(),
                             "in_flight": self.admission.count,
                             "backends": [b.describe() for b in self.pool.backends()]})

    async def ready(self, _request: HttpRequest) -> Response:
        ready, summary = self.readiness()
        return JSONResponse({"ready": ready, "summary": summary}, status_code=200 if ready else 503)

    async def metrics(self, _request: HttpRequest) -> Response:
        self.in_flight.set(self.admission.count)
        for role in ROLES:
            self.queued.labels(role).set(self.pool.waiting(role))
        self.stale_retries.set(self.client.stale_retries)
        for gauge in (self.backend_in_flight, self.backend_healthy, self.ejections):
            gauge.clear()
        for b in self.pool.backends():
            self.backend_in_flight.labels(b.role, b.url).set(b.in_flight)
            self.backend_healthy.labels(b.role, b.url).set(1 if b.routable else 0)
            self.ejections.labels(b.role, b.url).set(b.ejections)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- routing -----------------------------------------------------------------------------

    async def _route(self, request: HttpRequest, path: str, received: float) -> Response:
        """Routes one request; a client that leaves before the answer cancels the upstream calls
        (closing their connections, so the engines abort the request and free its pages)."""
        report = request.headers.get(PHASES_HEADER, "").strip().lower() in ("1", "true")

        def timing() -> RequestTiming:  # one per sequence sent to the engines
            return self.phases.start(received, request.headers, report)
        try:
            ticket = self.admission.enter()
        except Overloaded as exc:
            self.requests.labels("overloaded").inc()
            return error_json(str(exc), 503, "overloaded", retry_after=self.cfg.retry_after_s)
        relaying = False
        try:
            body = await read_json(request)
            work = asyncio.ensure_future(self._answer(body, path, timing))
            gone = asyncio.ensure_future(wait_for_disconnect(request))
            try:
                await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    answer = await work
                    if isinstance(answer, Answer):
                        await answer.close()
                self.requests.labels("client_gone").inc()
                return Response(status_code=499)
            result = work.result()
            if isinstance(result, StreamingResponse):  # a fanned-out stream: admitted until it ends
                relaying = True
                return RelayResponse(_release_at_end(result.body_iterator, ticket), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
            if not isinstance(result, Answer):
                return result
            if result.events is None:  # non-streamed: the whole answer is in
                await result.close()
                self.phases.close(result.timing)
                self.requests.labels("ok").inc()
                return Response(result.content, media_type="application/json")
            relaying = True
            return RelayResponse(self._relay(result, ticket), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
        finally:
            if not relaying:
                ticket.release()

    def _tokenized(self, path: str, body: dict) -> TokenizedPrompt | None:
        """The prompt's ids with the engines' tokenizer (cache-aware routing holds it), or None."""
        if self.routing is None:
            return None
        return self.routing.tokenize(path, body, self.cfg.transfer_control_key)

    async def _answer(self, body: Any, path: str, timing: Callable[[], RequestTiming]) -> Answer | Response:
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        if self.cfg.disaggregated:  # one sequence per pair: n > 1 and prompt lists fan out
            sequences = split_sequences(body)
            if len(sequences) > 1:
                prefills = {s.prompt_index: PrefillAffinity() for s in sequences}
                prompts: dict[int, TokenizedPrompt | None] = {}  # each prompt tokenized once for its samples
                for s in sequences:
                    if s.prompt_index not in prompts:
                        prompts[s.prompt_index] = self._tokenized(path, s.body)

                def send_one(one: Sequence) -> Awaitable[Response]:
                    prompt = prompts[one.prompt_index]
                    return self._one_sequence({**one.body, **(prompt.fields if prompt else {})}, path,
                                              prefills[one.prompt_index], prompt.ids if prompt else None, timing())
                merged = await fan_out(body, sequences, send_one)
                # Counted once, as the client's one request (its sequences are not counted).
                if isinstance(merged, StreamingResponse):
                    merged.body_iterator = self._counted_stream(merged.body_iterator)
                else:
                    self.requests.labels(_outcome_of(merged)).inc()
                return merged
            body = sequences[0].body
        prompt = self._tokenized(path, body)
        if prompt is None:
            return await self._dispatch(body, path, timing=timing())
        return await self._dispatch({**body, **prompt.fields}, path, prompt_ids=prompt.ids, timing=timing())

    async def _counted_stream(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A fanned-out stream, counted once when it ends (broken if a sequence's stream broke)."""
        outcome = "ok"
        try:
            async for chunk in events:
                if isinstance(chunk, bytes) and chunk.startswith(b'data: {"error"'):
                    outcome = "broken_stream"
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            raise
        finally:
            self.requests.labels(outcome).inc()
            await events.aclose()  # type: ignore[attr-defined]

    async def _one_sequence(self, body: dict, path: str, prefill: PrefillAffinity,
                            prompt_ids: list[int] | None, timing: RequestTiming) -> Response:
        """One sequence of a fanned-out request, as a response the fan-out merges."""
        answer = await self._dispatch(body, path, prefill, count=False, prompt_ids=prompt_ids, timing=timing)
        if not isinstance(answer, Answer):
            return answer
        if answer.events is None:
            await answer.close()
            self.phases.close(timing)
            return Response(answer.content, media_type="application/json")
        return RelayResponse(self._relay(answer, None, count=False), media_type="text/event-stream")

    async def _dispatch(self, body: dict, path: str, prefill: PrefillAffinity | None = None,
                        count: bool = True, prompt_ids: list[int] | None = None,
                        timing: RequestTiming | None = None) -> Answer | Response:
        """`_send`, with the request's timing handed to its answer (or closed, when there is none)."""
        result: Answer | Response | None = None
        try:
            result = await self._send(body, path, prefill, count, prompt_ids, timing)
            return result
        finally:
            if isinstance(result, Answer):
                result.timing = timing
            else:
                self.phases.close(timing, "no answer" if result is None else f"HTTP {result.status_code}")

    async def _send(self, body: dict, path: str, prefill: PrefillAffinity | None, count: bool,
                    prompt_ids: list[int] | None, timing: RequestTiming | None) -> Answer | Response:
        stream = body.get("stream") is True

        def counted(outcome: str) -> None:
            if count:
                self.requests.labels(outcome).inc()
        try:
            return await self.pairs.dispatch(path, body, stream, self.cfg.disaggregated, prefill, prompt_ids, timing)
        except Overloaded as exc:
            counted("overloaded")
            return error_json(str(exc), 503, "overloaded", retry_after=self.cfg.retry_after_s)
        except EncodersUnavailable as exc:
            counted("no_backend")
            return error_json(str(exc), 503, "no_encoder", retry_after=self.cfg.retry_after_s)
        except NoBackend as exc:
            counted("no_backend")
            return error_json(str(exc), 503, "no_backend", retry_after=self.cfg.retry_after_s)
        except UpstreamFailure as failure:
            if failure.kind == "client":
                counted("client_error")
                return Response(json.dumps(failure.body).encode(), status_code=failure.status,
                                media_type="application/json")
            counted("error")
            return error_json(f"request failed on every backend tried; last: {failure}", 503, "upstream_failed",
                              retry_after=self.cfg.retry_after_s)

    async def _relay(self, answer: Answer, ticket: Admission.Ticket | None, count: bool = True) -> AsyncIterator[bytes]:
        """Relays a stream that has its first token; a failure from here on ends it with an error event."""
        outcome = "ok"
        timing = answer.timing
        try:
            for event in answer.head:
                yield event
            assert answer.events is not None
            try:
                async for event in answer.events:
                    if timing is not None and timing.report and event.startswith(b"data: [DONE]"):
                        phases = await self.phases.settle(timing, answer.prefill_task)
                        yield phases_comment(timing, phases, self.cfg.disaggregated)
                    if timing is not None and timing.relayed is None:  # the first token's chunk goes out
                        timing.relayed = time.time()
                    yield event
                if timing is not None:
                    await self.phases.settle(timing, answer.prefill_task)
            except UpstreamFailure as failure:
                outcome = "broken_stream"
                if failure.kind in EJECTING_KINDS:
                    self.pool.report_failure(failure.backend, str(failure))
                logger.warning("stream broke after its first token: %s", failure)
                yield sse_error_event(f"the stream broke after its first token: {failure}")
                yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"
            raise
        finally:
            if count:
                self.requests.labels(outcome).inc()
            self.phases.close(timing, None if outcome == "ok" else outcome)
            try:
                await answer.close()
            finally:
                if ticket is not None:
                    ticket.release()


OUTCOME_OF_CODE = {"overloaded": "overloaded", "no_backend": "no_backend", "no_encoder": "no_backend"}


def _outcome_of(response: Response) -> str:
    """The request counter's outcome for a whole answer (a fanned-out request's merged one)."""
    if response.status_code == 200:
        return "ok"
    if response.status_code < 500:
        return "client_error"
    try:
        code = (json.loads(bytes(response.body)).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return OUTCOME_OF_CODE.get(code, "error")


async def _release_at_end(events: AsyncIterator[bytes], ticket: Admission.Ticket) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        try:
            await events.aclose()  # type: ignore[attr-defined]
        finally:
            ticket.release()
