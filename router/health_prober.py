"""Active health: probes each backend's ``/health``, every round while healthy, with backoff once ejected,
and at once a backend the pool marks suspect (the last of its role, after a failed request)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from splitserve.router.backend_pool import Backend, BackendPool
from splitserve.router.role_changes import follow_engine_role

logger = logging.getLogger(__name__)


class HealthProber:
    """Probes the pool's backends and tells the pool what it saw."""

    def __init__(self, pool: BackendPool, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        self.pool, self.client = pool, client
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._soon: dict[Backend, asyncio.Task] = {}
        pool.on_suspect = self.probe_soon

    def probe_soon(self, backend: Backend) -> None:
        """Probes ``backend`` now, outside the rounds (once at a time per backend)."""
        if backend not in self._soon:
            task = asyncio.ensure_future(self.probe(backend))
            self._soon[backend] = task
            task.add_done_callback(lambda _t: self._soon.pop(backend, None))

    async def probe(self, backend: Backend) -> None:
        try:
            r = await self.client.get(f"{backend.url}/health", timeout=self.timeout_s)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            self.pool.eject(backend, f"health probe: {type(exc).__name__}: {exc}")
            return
        if info is None:
            self.pool.eject(backend, f"health probe answered {r.status_code}: {r.text[:200]}")
        else:
            info = info if isinstance(info, dict) else {}
            if not follow_engine_role(self.pool, backend, info):  # a role switch moves it (or it drains)
                self.pool.admit(backend, info)

    async def probe_due(self) -> None:
        await asyncio.gather(*(self.probe(b) for b in self.pool.due_for_probe()))

    async def run(self) -> None:
        while True:
            try:
                await self.probe_due()
            except Exception:  # a probe round must never end the loop
                logger.exception("health probe round failed")
            await asyncio.sleep(self.interval_s)
