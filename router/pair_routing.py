"""Sending one request to a prefill+decode pair (or a unified replica), retrying before its first token.

An attempt opens the prefill and the decode call together and watches both, and the pool's
ejection of either: a decode that dies is noticed at once (its connection breaks), not after the
prefill's bootstrap timeout. Until the client has its first token (for a non-streamed request:
until the whole answer is in), a failed attempt is dropped, closing its calls so the engines
abort and free its pages, and the request is retried on another decode and another prefill;
never on a backend that just failed. A streamed answer is read up to its first token before
anything goes to the client, so that a decode failing before it is retried too: the engine marks that
token with an SSE comment (asked for with the internal `first_token_event`), whatever its text, so a
first token that decodes to no text yet (part of a UTF-8 character, a skipped special token) does not
hold the stream back; the rest is relayed as it arrives, unparsed. The encoders an
attempt's images went to are watched the same way until the prefill answered (their rows are in
by then): an encoder ejected meanwhile ends the attempt, and the retry encodes again elsewhere
(a failed encoder does not make the next attempt avoid the prefill and decode it used).
A failed request does not eject the last healthy backend of its role (the pool probes it at once).
A request that finds no healthy backend of a role waits for one, up to ``backend_wait_s`` in all: the
verdict of such a probe, an engine restarted after a crash, a new one joining. A backend that failed the
request is never tried again for it, unless it has been admitted again since (a restarted engine passed
its probe): then the request, which has sent nothing to the client yet, may run there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx

from splitserve.api.openai_protocol import FIRST_TOKEN_FIELD, first_token_marks
from splitserve.router.backend_pool import Backend, BackendPool, Lease, NoBackend, NotYourTurn, Overloaded
from splitserve.router.cache_routing import CacheAwareRouting, RoutePlan
from splitserve.router.phases import RequestTiming
from splitserve.router.upstream import (
    EJECTING_KINDS,
    UpstreamFailure,
    event_kind,
    open_stream,
    post_json,
    sse_events,
    unreachable,
)
from splitserve.transfer.bootstrap_grant import SIGNATURE_FIELD, sign_bootstrap

logger = logging.getLogger(__name__)


def pair_request(body: dict, host: str, port: int, room: int, key: str) -> dict:
    """The body both engines of a pair get: the request plus where they meet (the prefill's
    bootstrap server and a room), signed with the group's key so the engines know the router
    chose it."""
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if key:
        fields[SIGNATURE_FIELD] = sign_bootstrap(key, host, port, room)
    return {**body, **fields}


@dataclass(eq=False)
class Answer:
    """An attempt that got its answer: the whole body, or a stream opened up to its first token."""

    lease: Lease  # on the decode (or unified) backend, until the answer is relayed
    content: bytes = b""  # non-streamed
    head: list[bytes] = field(default_factory=list)  # streamed: the events read so far
    events: AsyncIterator[bytes] | None = None  # streamed: the rest
    response: httpx.Response | None = None
    prefill_task: asyncio.Task | None = None  # the prefill call, if it has not answered yet
    timing: RequestTiming | None = None  # where its time to first token went (router/phases.py)
    cached_tokens: int | None = None  # streamed: the prompt tokens its cache held, from the first-token marker

    @property
    def backend(self) -> Backend:
        return self.lease.backend

    async def close(self) -> None:
        """Ends every call of the attempt (closing a call aborts the request on its engine)."""
        try:
            if self.prefill_task is not None:
                await _abandon(self.prefill_task)
            if self.response is not None:
                await self.response.aclose()
        finally:
            self.lease.release()


async def _abandon(task: asyncio.Task) -> None:
    """Cancels a call and waits for it; a call that had already answered is closed."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, UpstreamFailure):
        result = await task
        if isinstance(result, Answer):
            await result.close()


async def _first_ejected(backends: list[Backend]) -> Backend:
    waits = {asyncio.ensure_future(b.ejected.wait()): b for b in backends}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return waits[next(iter(done))]
    finally:
        for w in waits:
            w.cancel()


@dataclass
class Waits:
    """How long one request may still wait, over all its roles and attempts."""

    queue_until: float  # for a slot while every backend of a role is full (the loop's clock)
    backend_until: float | None = None  # for a healthy backend while a role has none: set the first time


@dataclass
class PrefillAffinity:
    """The prefill engine the sequences of one prompt share (the first pick sets it), so that
    its prefix cache computes the prompt once for all n samples."""

    url: str | None = None


class PairRouter:
    """Runs requests on pairs (or unified replicas) from the pool, with retries."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, key: str, retries: int,
                 on_retry=lambda: None, prepare=None, routing: CacheAwareRouting | None = None,
                 backend_wait_s: float = 0.0, queue_timeout_s: float = 0.0) -> None:
        self.pool, self.client, self.key, self.retries = pool, client, key, retries
        self.backend_wait_s = backend_wait_s  # how long a request waits for a healthy backend when there is none
        self.queue_timeout_s = queue_timeout_s  # how long a request waits for a slot when every backend is full
        self.on_retry = on_retry
        # Chooses the unified replica or the prefill by cached prefix (None: by load alone).
        self.routing = routing
        # Per attempt, before any backend is leased: the images sent to encoders (new rooms each time);
        # returns an object with the attempt's `body` and the `encoders` to watch.
        self.prepare = prepare

    async def dispatch(self, path: str, body: dict, stream: bool, disaggregated: bool,
                       affinity: PrefillAffinity | None = None, prompt_ids: Sequence[int] | None = None,
                       timing: RequestTiming | None = None) -> Answer:
        """Runs one request until an attempt answers; raises the last UpstreamFailure (or NoBackend
        / Overloaded when there is nothing to try). With an `affinity`, the prefill it names is
        preferred (and the first pick names it). With the prompt's ids (`CacheAwareRouting.tokenize`),
        the unified replica or prefill is chosen by cached prefix. With a `timing`, the attempt that answers
        stamps it (sent, first token) and the engines' stamps land there (router/phases.py)."""
        avoid: set[str] = set()  # backends of failed attempts: others first
        failed: dict[Backend, int] = {}  # backends that failed themselves: never again, unless admitted again since
        last: UpstreamFailure | None = None
        plan = self.routing.plan(prompt_ids) if self.routing is not None else None
        waits = Waits(asyncio.get_running_loop().time() + self.queue_timeout_s)
        for attempt in range(1 + max(0, self.retries)):
            prepared = await self.prepare(body) if self.prepare is not None else None
            attempt_body = prepared.body if prepared is not None else body
            encoders = prepared.encoders if prepared is not None else []
            try:
                main = await self._lease("decode" if disaggregated else "unified", avoid, failed,
                                         plan=None if disaggregated else plan, waits=waits)
            except NoBackend as none:
                raise _after(none, last) from None
            try:
                prefill = (await self._lease("prefill", avoid, failed, affinity.url if affinity else None, plan,
                                             waits) if disaggregated else None)
            except NoBackend as none:
                main.release()
                raise _after(none, last) from None
            except BaseException:
                main.release()
                if last is not None:
                    raise last from None
                raise
            if affinity is not None and prefill is not None and affinity.url is None:
                affinity.url = prefill.backend.url
            if attempt:
                self.on_retry()
                logger.warning("retrying on %s after: %s", main.backend.url if prefill is None else
                               f"{prefill.backend.url} + {main.backend.url}", last)
            try:
                return await self._attempt(prefill, main, path, attempt_body, stream, encoders, timing,
                                           planned=plan is not None)
            except UpstreamFailure as failure:
                if failure.kind == "client":
                    raise
                last = failure
                if failure.backend.role != "encode":  # the pair was not at fault for a dead encoder
                    avoid |= {main.backend.url, *([prefill.backend.url] if prefill else [])}
                if failure.kind in EJECTING_KINDS and not failure.backend.healthy:
                    # Ejected (a suspect may pass its probe: then retried there).
                    failed[failure.backend] = failure.backend.admissions
        assert last is not None
        raise last

    async def _lease(self, role: str, avoid: set[str], failed: dict[Backend, int], prefer: str | None = None,
                     plan: RoutePlan | None = None, waits: Waits | None = None) -> Lease:
        """`_pick`, waiting while the role has no healthy backend this request may use (up to backend_wait_s
        from the first time, over the whole request), and in the role's line while every candidate is at its
        in-flight limit (until `waits.queue_until`, the loop's clock; default queue_timeout_s from now)."""
        loop = asyncio.get_running_loop()
        if waits is None:
            waits = Waits(loop.time() + self.queue_timeout_s)
        turn: asyncio.Future[None] | None = None  # this request's place in the role's line, once it waits
        try:
            while True:
                try:
                    return self._pick(role, avoid, self.pool.still_failed(failed), prefer, plan, turn)
                except NoBackend as none:
                    if waits.backend_until is None:
                        waits.backend_until = loop.time() + self.backend_wait_s
                    if not await self.pool.wait_for_backend(role, waits.backend_until):
                        if self.backend_wait_s <= 0:
                            raise
                        raise NoBackend(f"{none}; waited {self.backend_wait_s:g} s for one "
                                        "(--backend-wait-s)") from None
                except Overloaded as full:
                    left = waits.queue_until - loop.time()
                    if left <= 0:
                        raise
                    # Not its turn: it keeps its place. No open slot it may take: if others could take one, it
                    # lets them pass.
                    passable = not isinstance(full, NotYourTurn) and self.pool.free_slots(role) > 0
                    turn = self.pool.join_line(role, turn, passable)
                    if not await self.pool.wait_for_slot(turn, left):
                        raise Overloaded(f"{full}; waited {self.queue_timeout_s:g} s for a slot "
                                         "(--queue-timeout-s)") from None
        finally:
            if turn is not None:
                self.pool.leave_line(role, turn)

    def _pick(self, role: str, avoid: set[str], never: set[str], prefer: str | None = None,
              plan: RoutePlan | None = None, turn: asyncio.Future[None] | None = None) -> Lease:
        """A lease on a backend of `role`: by cached prefix and load with a plan, else by load."""
        if plan is None:
            return self.pool.pick(role, avoid, never, prefer, turn=turn)
        lease = self.pool.pick(role, avoid, never, prefer, choose=plan.choose, turn=turn)
        lease.on_release.append(plan.take_release())
        return lease

    async def _attempt(self, prefill: Lease | None, main: Lease, path: str, body: dict, stream: bool,
                       encoders: list[Backend] | None = None, timing: RequestTiming | None = None,
                       planned: bool = False) -> Answer:
        """One try on a pair (or a unified replica). `planned`: the cache-aware choice picked it, so what the
        engine reports from its cache is counted against the prediction."""
        if prefill is not None:
            backend = prefill.backend
            body = pair_request(body, backend.bootstrap_host or "", backend.bootstrap_port or 0,
                                secrets.randbits(63), self.key)
        if timing is not None:
            timing.sent, timing.engine, timing.prefill = time.time(), None, None  # this attempt's, not an earlier one's
        main_task = asyncio.ensure_future(self._answer(main, path, body, stream, timing))
        prefill_task = (asyncio.ensure_future(self._prefill(prefill, path, body, timing, planned))
                        if prefill is not None else None)
        watch = asyncio.ensure_future(_first_ejected([main.backend, *([prefill.backend] if prefill else []),
                                                      *(encoders or [])]))
        waiting = {main_task, watch, *([prefill_task] if prefill_task else [])}
        answered = False
        try:
            while True:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                failures = [t.exception() for t in done if t is not watch and t.exception() is not None]
                for f in failures:
                    if isinstance(f, UpstreamFailure) and f.kind in EJECTING_KINDS:
                        self.pool.report_failure(f.backend, str(f))
                if failures:
                    # The failure that blames an engine explains the others (a decode whose prefill died).
                    raise min(failures, key=lambda f: not (isinstance(f, UpstreamFailure)
                                                           and f.kind in EJECTING_KINDS))
                if main_task in done:
                    answer = main_task.result()
                    if prefill is None and planned and self.routing is not None:  # a pair's: its prefill's
                        self.routing.reported(main.backend.url, answer.cached_tokens if stream
                                              else _cached_tokens(_json_object(answer.content)))
                    answer.prefill_task = prefill_task if prefill_task is not None and not prefill_task.done() \
                        else None
                    answered = True
                    return answer
                if watch in done:
                    ejected = watch.result()
                    raise UpstreamFailure(ejected, "unreachable", 0, ejected.last_error or "ejected")
                # The prefill answered (its KV is on the decode); only the decode matters now.
                waiting -= done
                watch.cancel()
                watch = asyncio.ensure_future(_first_ejected([main.backend]))
                waiting = {main_task, watch}
        finally:
            watch.cancel()
            if not answered:
                await _abandon(main_task)
                if prefill_task is not None:
                    await _abandon(prefill_task)
                main.release()

    async def _prefill(self, lease: Lease, path: str, body: dict, timing: RequestTiming | None = None,
                       planned: bool = False) -> None:
        prefill_body = {**body, "stream": False}
        prefill_body.pop("stream_options", None)
        try:
            content = await post_json(self.client, lease.backend, path, prefill_body,
                                      timing.headers if timing is not None else None)
        finally:
            lease.release()
        answer = _json_object(content)
        if timing is not None:
            marks = answer.get("phase_marks")  # engine/phase_timing.py's stamps, if it has them
            timing.prefill = marks if isinstance(marks, dict) else None
        if planned and self.routing is not None:
            self.routing.reported(lease.backend.url, _cached_tokens(answer))

    async def _answer(self, lease: Lease, path: str, body: dict, stream: bool,
                      timing: RequestTiming | None = None) -> Answer:
        """The decode's (or unified replica's) answer: whole, or streamed up to its first token."""
        backend = lease.backend
        if stream:  # the engine marks its first token, whatever its text (it may decode to none yet)
            body = {**body, FIRST_TOKEN_FIELD: True}
        response = await open_stream(self.client, backend, path, body, timing.headers if timing is not None else None)
        answer = Answer(lease, response=response)
        try:
            if not stream:
                try:
                    answer.content = await response.aread()
                except httpx.HTTPError as exc:
                    raise unreachable(backend, exc) from exc
                return answer
            answer.events = sse_events(backend, response)
            async for event in answer.events:
                kind = event_kind(event)
                if kind.error is not None:
                    raise UpstreamFailure(backend, "request", 200, kind.error)
                if kind.first_token:  # the engine's marker: consumed here, never relayed
                    marks, answer.cached_tokens = first_token_marks(event)
                    if timing is not None:
                        timing.first_token, timing.engine = time.time(), marks
                    return answer
                answer.head.append(event)
                if kind.token or kind.done:
                    if timing is not None:
                        timing.first_token = time.time()
                    return answer
            raise UpstreamFailure(backend, "unreachable", 200, "the stream ended before its first token")
        except BaseException:
            await response.aclose()
            raise


def _after(none: NoBackend, failure: UpstreamFailure | None) -> NoBackend:
    """No backend to retry on, saying what failed the request before (pure)."""
    return none if failure is None else NoBackend(f"{none}; the request had failed: {failure}")


def _json_object(content: bytes) -> dict:
    """An engine's answer as a JSON object ({} where it is not one)."""
    try:
        body = json.loads(content)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _cached_tokens(answer: dict) -> int | None:
    """Cached prompt tokens in an engine's answer: a prefill's (`cached_tokens`) or a whole completion's
    (`usage.prompt_tokens_details.cached_tokens`); None where it has none."""
    try:
        if "cached_tokens" in answer:
            return int(answer["cached_tokens"])
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (TypeError, KeyError, ValueError):
        return None
