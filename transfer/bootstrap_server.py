"""The prefill replica's bootstrap server: where decode ranks find the prefill's KV layout.

HTTP (starlette on uvicorn, in a background thread of prefill rank 0):
- ``PUT /layout``: a prefill rank registers its ``KVLayout`` (JSON of ``KVLayout.to_dict``).
  A rank registering again (restart) replaces its entry; a layout that disagrees with the
  ranks already registered (TP size, heads, page size, dtype, layers) answers 409.
- ``GET /layout``: ``{"tp_size": n, "ranks": [layout of rank 0, ...]}`` once every rank has
  registered, 503 (with who is missing) until then: that is the prefill's readiness.
- ``GET /health``: 200 while the server runs, with the registration count.

With a key (``transfer_control_key``) every route but ``/health`` needs the header
``X-Splitserve-Key``; without one the server trusts its network, like Mooncake's own ports.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from splitserve.transfer.bootstrap_grant import KEY_HEADER
from splitserve.transfer.errors import BootstrapError, LayoutMismatchError
from splitserve.transfer.kv.layout import KVLayout

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998


class LayoutRegistry:
    """The ranks registered so far (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, KVLayout] = {}

    def register(self, layout: KVLayout) -> None:
        """Adds or replaces ``layout.tp_rank``; raises ``LayoutMismatchError`` on disagreement."""
        with self._lock:
            for rank, other in self._ranks.items():
                if rank == layout.tp_rank:
                    continue
                if other.tp_size != layout.tp_size:
                    raise LayoutMismatchError("tp_size", other.tp_size, layout.tp_size,
                                              f"rank {layout.tp_rank} vs registered rank {rank}")
                other.check_compatible(layout, f"rank {layout.tp_rank} vs registered rank {rank}")
            self._ranks[layout.tp_rank] = layout

    def complete(self) -> list[KVLayout] | None:
        """Every rank's layout in rank order, or None while some are missing."""
        with self._lock:
            if not self._ranks:
                return None
            tp_size = next(iter(self._ranks.values())).tp_size
            if len(self._ranks) < tp_size:
                return None
            return [self._ranks[r] for r in range(tp_size)]

    def summary(self) -> dict[str, object]:
        with self._lock:
            tp_size = next(iter(self._ranks.values())).tp_size if self._ranks else None
            return {"tp_size": tp_size, "registered": sorted(self._ranks)}


def build_bootstrap_app(registry: LayoutRegistry, key: str = "") -> Starlette:
    """The starlette app serving ``registry``."""

    def authorized(request: Request) -> bool:
        return not key or hmac.compare_digest(request.headers.get(KEY_HEADER, ""), key)

    async def put_layout(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": "missing or wrong " + KEY_HEADER}, status_code=401)
        try:
            layout = KVLayout.from_dict(json.loads(await request.body()))
        except (ValueError, LayoutMismatchError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            registry.register(layout)
        except LayoutMismatchError as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        log.info("bootstrap: registered tp rank %d/%d (%s)", layout.tp_rank, layout.tp_size,
                 layout.control_endpoint)
        return JSONResponse(registry.summary())

    async def get_layout(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": "missing or wrong " + KEY_HEADER}, status_code=401)
        ranks = registry.complete()
        if ranks is None:
            return JSONResponse({"error": "not every prefill rank has registered", **registry.summary()},
                                status_code=503)
        return JSONResponse({"tp_size": len(ranks), "ranks": [r.to_dict() for r in ranks]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "ready": registry.complete() is not None,
                             **registry.summary()})

    return Starlette(routes=[
        Route("/layout", put_layout, methods=["PUT"]),
        Route("/layout", get_layout, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])


class BootstrapServer:
    """Runs the bootstrap app on ``host:port`` (0: any free port) in a daemon thread."""

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_BOOTSTRAP_PORT, key: str = "") -> None:
        self.registry = LayoutRegistry()
        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise BootstrapError(f"cannot bind the bootstrap server to {host}:{port}: {exc}") from exc
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(build_bootstrap_app(self.registry, key), log_level="warning",
                                lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` as decode ranks should use it (loopback when bound to all interfaces)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> BootstrapServer:
        """Starts serving; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="transfer-bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise BootstrapError(f"bootstrap server on {self.address} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops serving and joins the thread."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()
