"""The router's pieces on their own: bootstrap grants (pair requests) and the backend pool."""

from __future__ import annotations

import pytest

from splitserve.router import pair_request
from splitserve.router.backend_pool import BackendPool, NoBackend, Overloaded
from splitserve.transfer.bootstrap_grant import SIGNATURE_FIELD, bootstrap_grant_valid


def test_pair_request_is_signed_with_the_groups_key_for_its_exact_triple() -> None:
    body = {"model": "m", "prompt": [1, 2]}
    pair = pair_request(body, "10.0.0.7", 8998, 12345, key="k" * 64)
    assert (pair["bootstrap_host"], pair["bootstrap_port"], pair["bootstrap_room"]) == ("10.0.0.7", 8998, 12345)
    assert bootstrap_grant_valid("k" * 64, "10.0.0.7", 8998, 12345, pair[SIGNATURE_FIELD])
    assert not bootstrap_grant_valid("k" * 64, "10.0.0.7", 8998, 12346, pair[SIGNATURE_FIELD])
    assert not bootstrap_grant_valid("other", "10.0.0.7", 8998, 12345, pair[SIGNATURE_FIELD])
    assert body == {"model": "m", "prompt": [1, 2]}  # the client's body is left as it was


def test_pair_request_without_a_key_carries_no_signature() -> None:
    assert SIGNATURE_FIELD not in pair_request({"prompt": "a"}, "h", 1, 2, key="")


# ---- the backend pool ------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def healthy_pool(clock: FakeClock, limit: int = 8, **roles: list[str]) -> BackendPool:
    pool = BackendPool(limit, backoff_s=0.5, backoff_max_s=4.0, clock=clock)
    for role, urls in roles.items():
        pool.replace(role, urls)
        for b in pool.backends(role):
            pool.admit(b, {"bootstrap_host": "h", "bootstrap_port": 1})
    return pool


def test_new_backends_are_routable_only_after_a_passing_probe() -> None:
    pool = BackendPool(8, 0.5, 4.0, clock=FakeClock())
    pool.replace("decode", ["http://d0/"])
    assert pool.healthy_count("decode") == 0 and [b.url for b in pool.due_for_probe()] == ["http://d0"]
    with pytest.raises(NoBackend):
        pool.pick("decode")
    pool.admit(pool.backends("decode")[0], {})
    assert pool.pick("decode").backend.url == "http://d0"


def test_a_prefill_without_a_bootstrap_port_is_not_admitted() -> None:
    pool = BackendPool(8, 0.5, 4.0, clock=FakeClock())
    pool.replace("prefill", ["http://p0"])
    pool.admit(pool.backends("prefill")[0], {"status": "ok"})
    assert pool.healthy_count("prefill") == 0


def test_ejection_is_at_once_and_probes_back_off_until_one_passes() -> None:
    clock = FakeClock()
    pool = healthy_pool(clock, decode=["http://d0", "http://d1"])
    d0 = pool.backends("decode")[0]
    pool.eject(d0, "connect error")
    assert not d0.healthy and d0.ejected.is_set() and d0.ejections == 1
    assert {pool.pick("decode").backend.url for _ in range(3)} == {"http://d1"}
    waits = []
    for _ in range(5):  # each failed probe doubles the wait, up to the cap
        waits.append(d0.next_probe_at - clock.now)
        assert d0 not in pool.due_for_probe()
        clock.now = d0.next_probe_at
        assert d0 in pool.due_for_probe()
        pool.eject(d0, "probe failed")
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert d0.ejections == 1  # one ejection, however many failed probes
    pool.admit(d0, {})
    assert d0.healthy and d0.failures == 0 and not d0.ejected.is_set()


def test_pick_prefers_the_least_loaded_avoids_what_failed_and_never_takes_what_must_not_be() -> None:
    pool = healthy_pool(FakeClock(), decode=["http://d0", "http://d1"])
    first = pool.pick("decode")
    assert pool.pick("decode").backend is not first.backend  # least loaded
    assert pool.pick("decode", avoid={"http://d0"}).backend.url == "http://d1"
    assert pool.pick("decode", avoid={"http://d0", "http://d1"}).backend.url in ("http://d0", "http://d1")
    with pytest.raises(NoBackend):
        pool.pick("decode", never={"http://d0", "http://d1"})


def test_ties_go_round_robin_so_one_request_at_a_time_reaches_every_backend() -> None:
    pool = healthy_pool(FakeClock(), decode=["http://d0", "http://d1", "http://d2"])
    picked = []
    for _ in range(6):  # a sequential client: each lease ends before the next pick
        lease = pool.pick("decode")
        picked.append(lease.backend.url[-2:])
        lease.release()
    assert picked == ["d0", "d1", "d2", "d0", "d1", "d2"]
    held = pool.pick("decode")  # d0 busy: the least loaded still wins, ties go on in turn
    assert [pool.pick("decode").backend.url[-2:] for _ in range(2)] == ["d1", "d2"]
    assert pool.pick("decode").backend.url[-2:] == "d0"  # all at 1 now: the turn comes back to d0
    held.release()
    assert [b.in_flight for b in pool.backends("decode")] == [1, 1, 1]
    assert pool.pick("decode", prefer="http://d2").backend.url == "http://d2"  # a prompt's prefill affinity


def test_leases_count_exactly_and_a_full_role_is_overloaded_not_waited_for() -> None:
    pool = healthy_pool(FakeClock(), limit=2, decode=["http://d0"])
    a, b = pool.pick("decode"), pool.pick("decode")
    with pytest.raises(Overloaded):
        pool.pick("decode")
    a.release()
    a.release()  # idempotent
    assert pool.backends("decode")[0].in_flight == 1
    b.release()
    assert pool.backends("decode")[0].in_flight == 0


def lessee(pool: BackendPool, queue_timeout_s: float, backend_wait_s: float = 0.0):
    """The router's way to a lease: PairRouter._lease (the wait for a healthy backend and the line), on `pool`;
    `never`: URLs that failed the request (as they are now)."""
    from splitserve.router.pair_routing import PairRouter

    router = PairRouter(pool, client=None, key="", retries=0, backend_wait_s=backend_wait_s,  # type: ignore[arg-type]
                        queue_timeout_s=queue_timeout_s)

    def lease(role: str = "decode", never=frozenset(), **kw):
        failed = {b: b.admissions for b in pool.backends() if b.url in never}
        return router._lease(role, set(), failed, **kw)
    return lease


def test_requests_past_the_limit_wait_in_line_first_come_first_served() -> None:
    """Full: a request waits; a release wakes the first in line; a newcomer does not pass those waiting, even
    while a slot is open for a woken one; the line is empty and the counts exact afterwards."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=2, decode=["http://d0", "http://d1"])
        lease = lessee(pool, queue_timeout_s=30)
        held = [await lease() for _ in range(4)]
        got: list[int] = []

        async def waiter(i: int):
            leased = await lease()
            got.append(i)
            return leased
        waiting = []
        for i in range(3):
            waiting.append(asyncio.ensure_future(waiter(i)))
            await asyncio.sleep(0)
        assert pool.waiting("decode") == 3 and got == []
        held.pop(0).release()  # one slot: the first in line takes it
        await asyncio.sleep(0)
        newcomer = asyncio.ensure_future(lease())  # arrives while the woken one has not picked yet
        for _ in range(3):
            await asyncio.sleep(0)
        assert got == [0] and not newcomer.done() and pool.waiting("decode") == 3
        held.pop(0).release()
        held.pop(0).release()
        for _ in range(5):
            await asyncio.sleep(0)
        assert got == [0, 1, 2] and not newcomer.done()
        held.pop(0).release()
        leases = [await w for w in waiting] + [await newcomer]
        assert pool.waiting("decode") == 0
        assert sorted(b.in_flight for b in pool.backends("decode")) == [2, 2]
        for leased in leases:
            leased.release()
        assert [b.in_flight for b in pool.backends("decode")] == [0, 0]
    asyncio.run(run())


def test_a_request_that_waits_past_the_queue_timeout_gets_overloaded_and_leaves_the_line() -> None:
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://d0"])
        held = pool.pick("decode")
        with pytest.raises(Overloaded, match=r"waited 0\.05 s for a slot"):
            await lessee(pool, queue_timeout_s=0.05)()
        with pytest.raises(Overloaded, match="1 requests in flight"):  # no wait allowed: at once
            await lessee(pool, queue_timeout_s=0)()
        assert pool.waiting("decode") == 0
        # A waiter whose client leaves (its task cancelled) leaves the line too, and the next one moves up.
        lease = lessee(pool, queue_timeout_s=30)
        gone = asyncio.ensure_future(lease())
        await asyncio.sleep(0)
        next_ = asyncio.ensure_future(lease())
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert pool.waiting("decode") == 1
        held.release()
        (await next_).release()
        assert pool.waiting("decode") == 0 and pool.backends("decode")[0].in_flight == 0
    asyncio.run(run())


def test_a_waiter_that_cannot_use_the_free_slot_lets_the_next_one_take_it() -> None:
    """A retry that must avoid the one backend with room does not hold up the line: the next waiter takes that slot,
    and the retry gets the next slot it can use."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://d0", "http://d1"])
        lease = lessee(pool, queue_timeout_s=30)
        on_d0, on_d1 = pool.pick("decode"), pool.pick("decode")
        retry = asyncio.ensure_future(lease(never={"http://d1"}))
        await asyncio.sleep(0)
        plain = asyncio.ensure_future(lease())
        await asyncio.sleep(0)
        assert pool.waiting("decode") == 2
        on_d1.release()  # room on d1 only: the retry is woken first, cannot take it, and passes it on
        got = await asyncio.wait_for(plain, 5)
        assert got.backend.url == "http://d1" and not retry.done() and pool.waiting("decode") == 1
        on_d0.release()
        assert (await asyncio.wait_for(retry, 5)).backend.url == "http://d0"
        assert pool.waiting("decode") == 0 and not pool._passable
    asyncio.run(run())


def test_a_slot_freed_on_a_draining_backend_does_not_let_the_line_be_passed() -> None:
    """Behind a retry that may not use x, B waits; a release on a draining backend frees no slot anyone may take, so
    B still takes x when it comes, and a newcomer does not get ahead of B."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://x", "http://y", "http://z"])
        lease = lessee(pool, queue_timeout_s=30)
        on_x, _on_y, on_z = (pool.pick("decode") for _ in range(3))
        pool.remove("decode", "http://z")  # draining: its request goes on
        a = asyncio.ensure_future(lease(never={"http://x"}))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(lease())
        await asyncio.sleep(0)
        on_x.release()  # A is woken, cannot take x, lets B pass
        line = pool._line["decode"]
        for _ in range(20):  # until A has passed x on to B, and before B's task runs
            await asyncio.sleep(0)
            if len(line) == 2 and line[1].done():
                break
        assert line[0] in pool._passable and line[1].done()
        on_z.release()  # z drained: no slot for anyone, and A stays passed over
        newcomer = asyncio.ensure_future(lease())
        assert (await asyncio.wait_for(b, 5)).backend.url == "http://x"
        await asyncio.sleep(0.01)
        assert not a.done() and not newcomer.done() and pool.waiting("decode") == 2
        for task in (a, newcomer):
            task.cancel()
        await asyncio.gather(a, newcomer, return_exceptions=True)
        assert pool.waiting("decode") == 0 and not pool._passable
    asyncio.run(run())


def test_a_backend_whose_drain_ends_takes_the_waiting_request() -> None:
    """An engine that drained for a role switch and takes requests again (its probe says so) wakes the line: the
    request waiting gets it, not a 503 at the queue timeout."""
    import asyncio

    from splitserve.router.role_changes import follow_engine_role

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://d0", "http://d1"])
        d1 = pool.backends("decode")[1]
        follow_engine_role(pool, d1, {"draining": True})
        held = pool.pick("decode")
        waiter = asyncio.ensure_future(lessee(pool, queue_timeout_s=5)())
        await asyncio.sleep(0)
        assert pool.waiting("decode") == 1
        assert not follow_engine_role(pool, d1, {"draining": False})  # what a passing probe does, then admits
        pool.admit(d1, {})
        leased = await asyncio.wait_for(waiter, 1)
        assert leased.backend is d1
        leased.release()
        held.release()
    asyncio.run(run())


def test_time_in_line_does_not_use_up_the_wait_for_a_healthy_backend() -> None:
    """A request that waited in line longer than backend_wait_s, when its role's last backend turns suspect, still
    waits for the probe's verdict: that wait counts from when no backend was healthy."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://d0"])
        d0 = pool.backends("decode")[0]
        held = pool.pick("decode")
        waiter = asyncio.ensure_future(lessee(pool, queue_timeout_s=30, backend_wait_s=0.2)())
        await asyncio.sleep(0.3)  # longer in line than the verdict wait
        pool.report_failure(d0, "a 5xx on another request")  # the last one: suspect, probed
        await asyncio.sleep(0.05)
        assert not waiter.done()
        pool.admit(d0, {})  # the probe passes
        held.release()
        (await asyncio.wait_for(waiter, 5)).release()
        assert pool.waiting("decode") == 0 and d0.in_flight == 0
    asyncio.run(run())


def test_a_backend_coming_back_wakes_every_waiter() -> None:
    """The set of open backends changed: those waiting look again, and take the new one's slots."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), limit=1, decode=["http://d0", "http://d1"])
        d1 = pool.backends("decode")[1]
        pool.eject(d1, "down")
        held = pool.pick("decode")
        waiter = asyncio.ensure_future(lessee(pool, queue_timeout_s=30)())
        await asyncio.sleep(0)
        assert pool.waiting("decode") == 1
        pool.admit(d1, {})
        leased = await asyncio.wait_for(waiter, 5)
        assert leased.backend is d1 and pool.waiting("decode") == 0
        leased.release()
        held.release()
    asyncio.run(run())


def test_a_removed_backend_drains_then_leaves_and_can_come_back() -> None:
    pool = healthy_pool(FakeClock(), decode=["http://d0", "http://d1"])
    lease = pool.pick("decode", avoid={"http://d1"})
    pool.replace("decode", ["http://d1", "http://d2"])
    d0 = lease.backend
    assert d0.draining and pool.urls("decode") == ["http://d1", "http://d2"]
    assert all(pool.pick("decode").backend.url == "http://d1" for _ in range(3))  # d2 not probed yet
    lease.release()
    assert [b.url for b in pool.backends("decode")] == ["http://d1", "http://d2"]  # drained and dropped
    pool.remove("decode", "http://d2")
    pool.add("decode", "http://d0")
    assert pool.urls("decode") == ["http://d1", "http://d0"]


def test_the_router_does_not_import_torch() -> None:
    """It starts (and restarts, under `up`) in a fraction of an engine's time, and holds no torch memory."""
    import subprocess
    import sys

    code = "import sys, splitserve.router.app; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:300]


def test_a_failed_request_ejects_a_backend_unless_it_is_the_last_of_its_role_then_a_probe_decides() -> None:
    import asyncio

    clock = FakeClock()
    pool = healthy_pool(clock, decode=["http://d0", "http://d1"], unified=["http://u0"])
    probed = []
    pool.on_suspect = probed.append
    d0, d1 = pool.backends("decode")
    assert pool.report_failure(d0, "ReadError") and not d0.healthy and d0.ejections == 1  # d1 is left
    assert not pool.report_failure(d1, "ReadError")  # the last one: suspect, not ejected
    assert d1.healthy and d1.suspect and not d1.routable and d1.ejections == 0 and probed == [d1]
    with pytest.raises(NoBackend):
        pool.pick("decode")
    assert not pool.report_failure(d1, "again") and probed == [d1]  # one probe per suspicion

    asyncio.run(verdict_on(pool, d1, passes=True))  # the waiting requests are woken at once
    assert d1.routable and not d1.suspect and pool.pick("decode").backend is d1
    u0 = pool.backends("unified")[0]
    assert not pool.report_failure(u0, "5xx") and u0.suspect
    asyncio.run(verdict_on(pool, u0, passes=False))
    assert not u0.healthy and not u0.suspect and u0.ejections == 1


def test_a_request_waits_for_a_restarted_backend_even_one_that_failed_it() -> None:
    """No healthy backend of the role: a request waits (backend_wait_s) for one. The backend that failed it is not
    tried again while it is the same incarnation, but once it is admitted again (restarted, its probe passed) it
    may take the request; the wait is bounded and its 503 says which flag bounds it."""
    import asyncio

    async def run() -> None:
        pool = healthy_pool(FakeClock(), decode=["http://d0"])
        d0 = pool.backends("decode")[0]
        pool.eject(d0, "killed")
        waiter = asyncio.ensure_future(lessee(pool, queue_timeout_s=0, backend_wait_s=5)(never={"http://d0"}))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        pool.admit(d0, {})  # the engine came back
        leased = await asyncio.wait_for(waiter, 1)
        assert leased.backend is d0 and d0.admissions == 2
        leased.release()

        pool.eject(d0, "killed again")
        started = asyncio.get_running_loop().time()
        with pytest.raises(NoBackend, match=r"waited 0.1 s for one \(--backend-wait-s\)"):
            await lessee(pool, queue_timeout_s=0, backend_wait_s=0.1)()
        assert asyncio.get_running_loop().time() - started >= 0.1
        with pytest.raises(NoBackend, match=r"^no healthy decode backend$"):  # 0: at once
            await lessee(pool, queue_timeout_s=0, backend_wait_s=0)()
        assert d0.in_flight == 0 and pool.waiting("decode") == 0
    asyncio.run(run())


def test_while_requests_wait_for_a_role_its_ejected_backends_are_probed_every_round() -> None:
    """Past the first failures the backoff spaces probes seconds apart; a request waiting for the role should not
    wait that long for a restarted engine, so while one waits, the role's ejected backends are due every round."""
    clock = FakeClock()
    pool = healthy_pool(clock, decode=["http://d0"], prefill=["http://p0"])
    d0 = pool.backends("decode")[0]
    for _ in range(5):
        pool.eject(d0, "down")
    assert d0.next_probe_at - clock.now == 4.0 and pool.due_for_probe() == pool.backends("prefill")
    with pool.wanting("decode"), pool.wanting("decode"):
        assert d0 in pool.due_for_probe()
    with pool.wanting("prefill"):  # another role's waiters do not hurry it
        assert d0 not in pool.due_for_probe()
    assert pool.due_for_probe() == pool.backends("prefill") and pool._wanting["decode"] == 0


def test_a_backend_that_failed_a_request_stays_failed_for_it_until_admitted_again() -> None:
    pool = healthy_pool(FakeClock(), decode=["http://d0", "http://d1"])
    d0, d1 = pool.backends("decode")
    failed = {d0: d0.admissions, d1: d1.admissions}
    pool.eject(d0, "down")
    pool.report_failure(d1, "5xx")  # the last one: suspect, then its probe passes: the same incarnation
    pool.admit(d1, {})
    assert pool.still_failed(failed) == {"http://d0", "http://d1"}
    pool.admit(d0, {})  # restarted and probed back in
    assert pool.still_failed(failed) == {"http://d1"}
    pool.remove("decode", "http://d1")
    pool.add("decode", "http://d1")  # dropped and added again: a new backend under the old URL
    assert pool.still_failed(failed) == set()


async def verdict_on(pool: BackendPool, backend, passes: bool) -> None:
    """A probe's verdict on a suspect backend, with a request waiting for it (woken at once)."""
    import asyncio

    waiter = asyncio.ensure_future(pool.wait_for_change(5))
    await asyncio.sleep(0)
    if passes:
        pool.admit(backend, {})
    else:
        pool.eject(backend, "probe failed")
    await asyncio.wait_for(waiter, 1)
