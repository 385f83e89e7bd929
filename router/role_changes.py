"""Following an engine's role as its /health reports it, so a runtime role switch (engine/role_switch.py)
reaches the router through its probes, whatever listed the engine (static lists, an Endpoints watch).

- While the engine says `draining`, it gets no new request; those it has go on to their end.
- Once it reports a role other than the one it is listed under (prefill <-> decode), it moves: it leaves
  the old role's set (draining there: requests still leased on it end normally) and joins the new
  role's, healthy at once (the probe that told passed) with a prefill's bootstrap address.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from splitserve.router.backend_pool import Backend, BackendPool

logger = logging.getLogger(__name__)

MOVABLE = ("prefill", "decode")  # the roles an engine switches between


def follow_engine_role(pool: BackendPool, backend: Backend, info: dict[str, Any]) -> bool:
    """Applies what a passing probe of `backend` says of its role. True when the backend moved to
    another role (the new entry is admitted here: the caller admits nothing more)."""
    draining = info.get("draining") is True
    if backend.engine_draining != draining:
        backend.engine_draining = draining
        logger.info("backend %s (%s) %s", backend.url, backend.role,
                    "is draining: no new requests" if draining else "takes requests again")
    role = info.get("role")
    if backend.draining or role == backend.role or role not in MOVABLE or backend.role not in MOVABLE:
        return False
    url, old = backend.url, backend.role
    pool.remove(old, url)
    pool.add(role, url)
    moved = next(b for b in pool.backends(role) if b.url == url)
    moved.engine_draining = draining
    pool.admit(moved, info)
    logger.info("backend %s switched role %s -> %s (%d request(s) still on it as %s)", url, old, role,
                backend.in_flight, old)
    return True


def with_reported_roles(urls: Mapping[str, list[str]], pool: BackendPool) -> dict[str, list[str]]:
    """An Endpoints watch's role -> URLs with each prefill or decode engine under the role its probes last
    reported: a pod of the prefill StatefulSet that switched to decode stays a decode backend when the
    Endpoints change, instead of leaving the decode set (and coming back to prefill until its next probe)."""
    reported = {b.url: b.role for b in pool.backends() if b.healthy and not b.draining and b.role in MOVABLE}
    out: dict[str, list[str]] = {}
    for role, role_urls in urls.items():
        for url in role_urls:
            now = reported.get(url.rstrip("/"), role) if role in MOVABLE else role
            out.setdefault(now, []).append(url)
    return {role: sorted(role_urls) for role, role_urls in out.items()}
