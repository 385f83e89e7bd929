"""The router's engines by role, with their health and load: who may get the next request.

A backend is routable while it is healthy (its last probe passed and nothing failed since)
and not draining. A failure (a connect error, a 5xx, a timeout, a failed probe) ejects it at
once; the prober then tries it again after a backoff that doubles with each failure in a row,
and a passing probe brings it back. A failed request alone (``report_failure``) does not eject
the last routable backend of a role: it becomes suspect instead (no new requests), is probed at
once, and the probe decides. A request that finds no routable backend of its role may wait for
one (``wait_for_change``): a verdict, a restarted engine passing its probe, a new one joining.
The set of URLs per role can change at runtime (``replace``): new URLs join once a probe passes,
URLs that leave drain (no new requests) and are dropped when their last request ends. Load is
counted by leases, released exactly once; the least loaded gets the next request, ties going
round robin.

When every routable backend of a role is at its in-flight limit, a request may wait for a slot
(``wait_for_slot``): the waiters of a role form a line, first come first served. A released lease
wakes the first of its role; a request that has not waited does not pass the line (``pick`` refuses
it while anyone waits: NotYourTurn); a health change wakes as many as there are open slots, and all
of them when the role has no routable backend left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "unified", "encode")


class NoBackend(Exception):
    """No healthy backend of a role (other than those a request must avoid)."""


class Overloaded(Exception):
    """Every healthy backend of a role is at its in-flight limit."""


class NotYourTurn(Overloaded):
    """A slot is open, but requests that came first wait for it."""


@dataclass(eq=False)
class Backend:
    """One engine behind the router."""

    url: str
    role: str
    in_flight: int = 0
    healthy: bool = False  # until its first probe passes
    draining: bool = False
    failures: int = 0  # in a row: drives the probe backoff
    next_probe_at: float = 0.0
    last_error: str = ""
    ejections: int = 0
    admissions: int = 0  # times it became healthy: a request it failed may go back to it once this grows
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    ejected: asyncio.Event = field(default_factory=asyncio.Event)  # set while ejected; wakes its requests
    suspect: bool = False  # a request on it failed while it was its role's last: a probe decides
    engine_draining: bool = False  # its /health says it refuses new requests (a role switch): its own go on

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and not self.suspect and not self.engine_draining

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "draining": self.draining,
                "engine_draining": self.engine_draining,
                "in_flight": self.in_flight, "failures": self.failures, "ejections": self.ejections,
                "suspect": self.suspect, "last_error": self.last_error}


class Lease:
    """One request's hold on a backend; ``release`` is idempotent, so the count stays exact."""

    def __init__(self, pool: BackendPool, backend: Backend) -> None:
        self.pool, self.backend, self.released = pool, backend, False
        self.on_release: list[Callable[[], None]] = []  # what else ends with the lease (a routing choice's load)
        backend.in_flight += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.backend.in_flight -= 1
            for done in self.on_release:
                done()
            self.pool._drop_if_drained(self.backend)
            if self.backend.routable:  # a slot others may take
                self.pool._slots_changed(self.backend.role)


class BackendPool:
    """Backends per role with health state and in-flight counts (one event loop's state)."""

    def __init__(self, max_in_flight_per_backend: int, backoff_s: float, backoff_max_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight_per_backend = max_in_flight_per_backend
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.clock = clock
        self._roles: dict[str, dict[str, Backend]] = {role: {} for role in ROLES}
        self._last_pick: dict[str, str] = {}  # per role: where the round robin among ties goes on from
        self.on_suspect: Callable[[Backend], None] = lambda _b: None  # the prober probes it at once
        self._change = asyncio.Event()  # set (and replaced) whenever a backend's health changes
        # Per role, the requests waiting for a slot, in arrival order: one future each, set to wake it; a woken
        # one stays in line (at its place) until its own pick is done, so nobody passes it meanwhile.
        self._line: dict[str, deque[asyncio.Future[None]]] = {role: deque() for role in ROLES}
        # Waiters that were woken but could use none of the open slots (a retry that must avoid the one backend
        # with room): those behind them may pass them until the next slot frees up.
        self._passable: set[asyncio.Future[None]] = set()
        # Per role, the requests waiting for a routable backend (there is none): its ejected ones are probed every
        # round meanwhile, not after their backoff, so a restarted engine is taken back within a round.
        self._wanting: dict[str, int] = dict.fromkeys(ROLES, 0)

    # ---- the set of backends -----------------------------------------------------------------

    def replace(self, role: str, urls: Iterable[str]) -> None:
        """Makes ``urls`` the role's set: new ones join (after a passing probe), missing ones drain."""
        wanted = [u.rstrip("/") for u in urls]
        current = self._roles[role]
        for url in wanted:
            if url not in current:
                current[url] = Backend(url, role)
                logger.info("backend %s (%s) added; routable once a probe passes", url, role)
            elif current[url].draining:
                current[url].draining = False
                logger.info("backend %s (%s) re-added", url, role)
                self._slots_changed(role)
        for url, backend in list(current.items()):
            if url not in wanted and not backend.draining:
                backend.draining = True
                logger.info("backend %s (%s) removed; draining %d request(s)", url, role, backend.in_flight)
                self._drop_if_drained(backend)

    def add(self, role: str, url: str) -> None:
        self.replace(role, [*self.urls(role), url])

    def remove(self, role: str, url: str) -> None:
        self.replace(role, [u for u in self.urls(role) if u != url.rstrip("/")])

    def urls(self, role: str) -> list[str]:
        """The role's current set (not counting backends that are draining)."""
        return [b.url for b in self._roles[role].values() if not b.draining]

    def backends(self, role: str | None = None) -> list[Backend]:
        roles = ROLES if role is None else (role,)
        return [b for r in roles for b in self._roles[r].values()]

    def _drop_if_drained(self, backend: Backend) -> None:
        if backend.draining and backend.in_flight == 0 and self._roles[backend.role].get(backend.url) is backend:
            del self._roles[backend.role][backend.url]
            logger.info("backend %s (%s) drained and dropped", backend.url, backend.role)

    # ---- choosing ----------------------------------------------------------------------------

    def healthy_count(self, role: str) -> int:
        return sum(b.routable for b in self._roles[role].values())

    def pick(self, role: str, avoid: set[str] = frozenset(), never: set[str] = frozenset(),  # type: ignore[assignment]
             prefer: str | None = None, choose: Callable[[list[Backend]], Backend] | None = None,
             turn: asyncio.Future[None] | None = None) -> Lease:
        """Leases the least-loaded routable backend of ``role`` (or the one ``choose`` picks of them, in
        round-robin order): one not in ``avoid`` if there is one, never one in ``never``; ``prefer`` if
        it is among those and under its limit (the samples of one prompt share a prefill). Raises
        NoBackend, or Overloaded when all are at the limit or others wait for a slot ahead of this
        request (``turn``: its place in the line, from ``join_line``; it may pick once woken with nobody
        unwoken ahead of it)."""
        candidates = [b for b in self._roles[role].values() if b.routable and b.url not in never]
        if not candidates:
            raise NoBackend(f"no healthy {role} backend" + (" left to retry on" if never else ""))
        open_ = [b for b in candidates if b.in_flight < self.max_in_flight_per_backend]
        if not open_:
            raise Overloaded(f"every healthy {role} backend has {self.max_in_flight_per_backend} requests in flight")
        line = self._line[role]
        if line and not (turn is not None and turn.done() and turn in line and self._ahead_gone(line, turn)):
            raise NotYourTurn(f"{len(line)} request(s) wait for a {role} slot ahead of this one")
        preferred = [b for b in open_ if b.url not in avoid] or open_
        sticky = next((b for b in preferred if b.url == prefer), None)
        if sticky is not None:
            return Lease(self, sticky)
        if choose is not None:
            chosen = choose(self._in_turn(role, preferred))
            self._last_pick[role] = chosen.url
            return Lease(self, chosen)
        least = min(b.in_flight for b in preferred)
        return Lease(self, self._next_in_turn(role, [b for b in preferred if b.in_flight == least]))

    # ---- the line of requests waiting for a slot ------------------------------------------------

    def waiting(self, role: str) -> int:
        """Requests of ``role`` waiting for a slot."""
        return len(self._line[role])

    def join_line(self, role: str, turn: asyncio.Future[None] | None = None,
                  passable: bool = False) -> asyncio.Future[None]:
        """A place at the end of ``role``'s line, or, for a ``turn`` that came but could not pick, a fresh one at
        that place. ``passable``: it could use none of the open slots (a retry that must avoid the backend with
        room), so those behind it may take them until the next release. The place is set when it is this
        request's turn (or a backend's health changed); ``leave_line`` gives it up, whatever happened."""
        line = self._line[role]
        fresh: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if turn is not None and turn in line:
            line[line.index(turn)] = fresh
            self._passable.discard(turn)
        else:
            line.append(fresh)
        if passable:
            self._passable.add(fresh)
        self._wake_next(role)  # a slot may be open for it or for those it lets pass
        return fresh

    def free_slots(self, role: str) -> int:
        """Slots open on ``role``'s routable backends."""
        return sum(max(0, self.max_in_flight_per_backend - b.in_flight)
                   for b in self._roles[role].values() if b.routable)

    def leave_line(self, role: str, turn: asyncio.Future[None]) -> None:
        """Gives up ``turn`` (a lease taken, a timeout, a client gone); the next waiter may take a slot it left."""
        line = self._line[role]
        if turn in line:
            line.remove(turn)
            self._passable.discard(turn)
            if not turn.done():
                turn.cancel()
            self._wake_next(role)

    @staticmethod
    async def wait_for_slot(turn: asyncio.Future[None], timeout: float) -> bool:
        """Waits for ``turn`` (join_line's) to come, up to ``timeout`` seconds; False when it did not."""
        if not turn.done():  # asyncio.wait, not wait_for: a cancelled request must not take the slot it was given
            await asyncio.wait({turn}, timeout=timeout)
        return turn.done()

    def _ahead_gone(self, line: deque[asyncio.Future[None]], turn: asyncio.Future[None]) -> bool:
        """Whether everyone ahead of ``turn`` in ``line`` was woken too (woken ones pick in any order) or may be
        passed."""
        for ahead in line:
            if ahead is turn:
                return True
            if not ahead.done() and ahead not in self._passable:
                return False
        return False

    def _wake_next(self, role: str) -> None:
        """Wakes waiters of ``role`` in line order, one per free slot of its routable backends (counting the woken
        ones that have not picked yet), passing those that could use none of the open slots."""
        line = self._line[role]
        if not line:
            return
        free = self.free_slots(role)
        woken = sum(1 for t in line if t.done())
        for turn in line:
            if woken >= free:
                break
            if not turn.done() and turn not in self._passable:
                turn.set_result(None)
                woken += 1

    def _slots_changed(self, role: str) -> None:
        """Slots of ``role`` opened (a lease ended, a backend became routable): the waiters passed over may try
        again, first in line first, and as many are woken as there are open slots."""
        self._passable.difference_update(self._line[role])
        self._wake_next(role)

    def _in_turn(self, role: str, backends: list[Backend]) -> list[Backend]:
        """`backends` in round-robin order: the first after the role's last pick first."""
        order = list(self._roles[role])
        last = self._last_pick.get(role)
        start = order.index(last) + 1 if last in order else 0
        return sorted(backends, key=lambda b: (order.index(b.url) - start) % len(order))

    def _next_in_turn(self, role: str, tied: list[Backend]) -> Backend:
        """Of equally loaded backends, the first after the role's last pick (round robin): a
        client sending one request at a time reaches every backend, not always the first."""
        order = list(self._roles[role])
        last = self._last_pick.get(role)
        start = order.index(last) + 1 if last in order else 0
        chosen = min(tied, key=lambda b: (order.index(b.url) - start) % len(order))
        self._last_pick[role] = chosen.url
        return chosen

    # ---- health ------------------------------------------------------------------------------

    def report_failure(self, backend: Backend, reason: str) -> bool:
        """A request on ``backend`` failed (a passive signal). Ejects it, unless it is the last
        routable backend of its role: then it is suspect until its probe (run at once) passes or
        fails. True if it was ejected."""
        others = [b for b in self._roles[backend.role].values() if b.routable and b is not backend]
        if not backend.healthy or others:
            self.eject(backend, reason)
            return not backend.healthy
        backend.last_error = reason
        if not backend.suspect:
            backend.suspect = True
            logger.warning("backend %s (%s), the last healthy %s, failed a request (%s): not ejected; probing it",
                           backend.url, backend.role, backend.role, reason)
            self._changed(backend.role)
            self.on_suspect(backend)
        return False

    def still_failed(self, failed: dict[Backend, int]) -> set[str]:
        """The URLs of ``failed`` (a request's: backend -> its ``admissions`` when it failed the request) that may
        not have the request again: a backend admitted since (an engine restarted, its probe passed) is a fresh
        start, and so is a backend dropped and added again under the same URL."""
        return {b.url for b, admissions in failed.items()
                if b.admissions == admissions and self._roles[b.role].get(b.url) is b}

    async def wait_for_change(self, timeout: float) -> None:
        """Returns when a backend's health changes, or after ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._change.wait(), timeout)

    def _changed(self, role: str) -> None:
        """A backend of ``role`` changed health: wakes requests awaiting a verdict, and the role's line."""
        self._change.set()
        self._change = asyncio.Event()
        if self.healthy_count(role) == 0:  # nothing left to wait for a slot on: each finds out (NoBackend)
            self._passable.difference_update(self._line[role])
            for turn in self._line[role]:
                if not turn.done():
                    turn.set_result(None)
        else:
            self._slots_changed(role)

    def eject(self, backend: Backend, reason: str) -> None:
        """Takes a backend out of rotation at once; the prober tries it again after a backoff."""
        if backend.suspect:
            backend.suspect = False
            self._changed(backend.role)
        backend.failures += 1
        backend.last_error = reason
        backend.next_probe_at = self.clock() + min(self.backoff_max_s, self.backoff_s * 2 ** (backend.failures - 1))
        if backend.healthy:
            backend.healthy = False
            backend.ejections += 1
            backend.ejected.set()
            logger.warning("backend %s (%s) ejected: %s", backend.url, backend.role, reason)
            self._changed(backend.role)
        else:
            logger.debug("backend %s (%s) still failing (%d in a row): %s", backend.url, backend.role,
                         backend.failures, reason)

    def admit(self, backend: Backend, info: dict) -> None:
        """A passing probe: the backend is healthy (again); a prefill's probe tells its bootstrap port."""
        if info.get("bootstrap_port") is not None:
            backend.bootstrap_host, backend.bootstrap_port = info.get("bootstrap_host"), int(info["bootstrap_port"])
        if backend.role == "prefill" and backend.bootstrap_port is None:
            self.eject(backend, "prefill reports no bootstrap port")
            return
        if not backend.healthy:
            logger.info("backend %s (%s) healthy%s", backend.url, backend.role,
                        f" again after {backend.failures} failed probe(s)" if backend.ejections else "")
        elif backend.suspect:
            logger.info("backend %s (%s) passed its probe after a failed request: it stays", backend.url,
                        backend.role)
        changed = not backend.healthy or backend.suspect
        backend.admissions += not backend.healthy
        backend.healthy, backend.suspect, backend.failures, backend.last_error = True, False, 0, ""
        backend.ejected.clear()
        if changed:
            self._changed(backend.role)
        else:  # routable again without a change of health (a role switch's drain ended): its slots may be free
            self._slots_changed(backend.role)

    def due_for_probe(self) -> list[Backend]:
        """Healthy backends (every round), ejected ones whose backoff has passed, and every ejected one of a role
        that requests wait for."""
        now = self.clock()
        return [b for b in self.backends() if b.healthy or b.next_probe_at <= now or self._wanting[b.role]]

    async def wait_for_backend(self, role: str, until: float) -> bool:
        """For a request that finds no routable backend of ``role``: waits for a change of health or for ``until``
        (the loop's clock), the role's ejected backends probed every round meanwhile. False once ``until`` has
        passed (no wait)."""
        left = until - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        with self.wanting(role):
            await self.wait_for_change(left)
        return True

    @contextlib.contextmanager
    def wanting(self, role: str) -> Iterator[None]:
        """Marks a request waiting for a routable backend of ``role`` (see ``due_for_probe``) while it lasts."""
        self._wanting[role] += 1
        try:
            yield
        finally:
            self._wanting[role] -= 1
