"""The router follows an engine's role from its /health: draining backends get no new request, a switched
one moves to its new role (its requests on the old one end normally)."""

from __future__ import annotations

import pytest

from splitserve.router.backend_pool import BackendPool, NoBackend
from splitserve.router.role_changes import follow_engine_role, with_reported_roles


def pool_of(**roles: list[str]) -> BackendPool:
    pool = BackendPool(8, backoff_s=0.5, backoff_max_s=4.0)
    for role, urls in roles.items():
        pool.replace(role, urls)
        for b in pool.backends(role):
            pool.admit(b, {"role": role, "bootstrap_host": "h", "bootstrap_port": 1})
    return pool


def probe(pool: BackendPool, url: str, role: str, info: dict) -> None:
    """What the prober does with a passing probe of `url` (listed under `role`)."""
    backend = next(b for b in pool.backends(role) if b.url == url)
    if not follow_engine_role(pool, backend, info):
        pool.admit(backend, info)


def test_a_draining_engine_gets_no_new_request_and_comes_back_when_it_stops_draining() -> None:
    pool = pool_of(prefill=["http://p0", "http://p1"], decode=["http://d0"])
    probe(pool, "http://p1", "prefill", {"role": "prefill", "draining": True, "bootstrap_port": 1})
    assert pool.healthy_count("prefill") == 1 and all(pool.pick("prefill").backend.url == "http://p0"
                                                      for _ in range(3))
    probe(pool, "http://p1", "prefill", {"role": "prefill", "draining": False, "bootstrap_port": 1})
    assert pool.healthy_count("prefill") == 2


def test_a_prefill_that_reports_decode_moves_there_and_its_leased_requests_end_on_the_old_entry() -> None:
    pool = pool_of(prefill=["http://p0", "http://p1"], decode=["http://d0"])
    lease = pool.pick("prefill", avoid={"http://p0"})
    assert lease.backend.url == "http://p1"
    probe(pool, "http://p1", "prefill", {"role": "decode", "draining": False})
    assert pool.urls("prefill") == ["http://p0"] and pool.urls("decode") == ["http://d0", "http://p1"]
    moved = next(b for b in pool.backends("decode") if b.url == "http://p1")
    assert moved.routable and moved.bootstrap_port is None
    assert lease.backend.draining and lease.backend in pool.backends("prefill")  # until its request ends
    lease.release()
    assert [b.url for b in pool.backends("prefill")] == ["http://p0"]
    assert {pool.pick("decode", avoid={"http://d0"}).backend.url} == {"http://p1"}


def test_a_decode_that_reports_prefill_moves_with_its_bootstrap_address_and_back_again() -> None:
    pool = pool_of(prefill=["http://p0"], decode=["http://d0", "http://d1"])
    probe(pool, "http://d1", "decode", {"role": "prefill", "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998})
    p1 = next(b for b in pool.backends("prefill") if b.url == "http://d1")
    assert p1.routable and (p1.bootstrap_host, p1.bootstrap_port) == ("10.0.0.5", 8998)
    assert pool.urls("decode") == ["http://d0"]
    probe(pool, "http://d1", "prefill", {"role": "decode"})
    assert pool.urls("decode") == ["http://d0", "http://d1"] and pool.urls("prefill") == ["http://p0"]
    assert pool.healthy_count("decode") == 2


def test_other_roles_and_a_missing_role_are_not_moved() -> None:
    pool = pool_of(unified=["http://u0"], encode=["http://e0"], decode=["http://d0"])
    probe(pool, "http://u0", "unified", {"role": "decode"})
    probe(pool, "http://e0", "encode", {"role": "prefill", "bootstrap_port": 1})
    probe(pool, "http://d0", "decode", {"status": "ok"})  # an older engine: no role in its /health
    assert pool.urls("unified") == ["http://u0"] and pool.urls("encode") == ["http://e0"]
    assert pool.urls("decode") == ["http://d0"] and pool.healthy_count("decode") == 1
    with pytest.raises(NoBackend):
        pool.pick("prefill")


def test_an_endpoints_change_keeps_a_switched_engine_in_the_role_it_reported() -> None:
    pool = pool_of(prefill=["http://p0", "http://p1"], decode=["http://d0"])
    probe(pool, "http://p1", "prefill", {"role": "decode"})  # p1's pod is still in the prefill Service
    listed = {"prefill": ["http://p0", "http://p1", "http://p2"], "decode": ["http://d0"], "encode": ["http://e0"]}
    assert with_reported_roles(listed, pool) == {"prefill": ["http://p0", "http://p2"],
                                                 "decode": ["http://d0", "http://p1"], "encode": ["http://e0"]}
    for role, urls in with_reported_roles(listed, pool).items():
        pool.replace(role, urls)
    assert pool.urls("decode") == ["http://d0", "http://p1"] and pool.healthy_count("decode") == 2
    # Restarted, it is a prefill again: its probe moves it back, and the Endpoints list has it there.
    probe(pool, "http://p1", "decode", {"role": "prefill", "bootstrap_port": 1})
    assert with_reported_roles(listed, pool)["prefill"] == ["http://p0", "http://p1", "http://p2"]
