"""Named server processes of one test on loopback ports, and the images multimodal tests send."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from servers import ServerProcess, free_port, wait_http_ok, wait_router_took_in


class ServerGroup:
    """Engines (one per name, a role each) and routers of one test, started on free ports; `wait` waits
    for every one (routers on /ready, engines on /health), `stop` stops them all."""

    def __init__(self, tmp: Path, checkpoint: Path, engine_args: list[str]) -> None:
        self.tmp, self.checkpoint, self.engine_args = tmp, checkpoint, engine_args
        self.procs: dict[str, tuple[str, ServerProcess]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.procs[name] = (url, ServerProcess([*args, "--port", str(port)], self.tmp / f"{name}.log", env))
        return url

    def engine(self, name: str, role: str, *extra: str, env: dict[str, str] | None = None) -> str:
        """Starts `serve --role ROLE`; `env` sets test hooks (environment variables only)."""
        return self.start(name, ["serve", "--role", role, "--model", str(self.checkpoint), *self.engine_args,
                                 *extra], env)

    def url(self, name: str) -> str:
        return self.procs[name][0]

    def pid(self, name: str) -> int:
        return self.procs[name][1].proc.pid

    def wait(self, timeout: float = 180.0) -> None:
        """Every engine answers /health, every router /ready and routes to each engine of the group it has."""
        routers = {url for name, (url, _) in self.procs.items() if name.startswith("router")}
        for url, proc in self.procs.values():
            wait_http_ok(f"{url}/ready" if url in routers else f"{url}/health", proc.proc, timeout, proc.log)
        engines = {url for url, _ in self.procs.values()} - routers
        for router in routers:
            wait_router_took_in(router, engines, time.monotonic() + timeout)

    def stop(self) -> None:
        for _, proc in self.procs.values():
            proc.stop()


def png_bytes(w: int, h: int, seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def png_url(w: int, h: int, seed: int, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(png_bytes(w, h, seed, fmt)).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """Posts every chat body at once; the answers in order."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=b) for b in bodies))
    return asyncio.run(run())


def kill_mid_write(d: ServerGroup, name: str) -> float:
    """Waits until encoder `name` has an item partly written (it pauses there with
    SPLITSERVE_EMBEDDING_WRITE_PAUSE_S), kills it -9 and returns when it died."""
    url, victim = d.procs[name]
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=5).json()["embedding"]["partly_written"] == 0:
        assert time.monotonic() < deadline, f"{name} never got an item partly written"
        time.sleep(0.02)
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.proc.wait()
    return killed_at


def answer_across_a_kill_mid_write(d: ServerGroup, router: str, case: dict,
                                   encoder: str) -> tuple[httpx.Response, float, float]:
    """Posts `case` to `router` and kills `encoder` -9 mid-write meanwhile: the answer, when it
    came and when the encoder died."""
    done: list[tuple[httpx.Response, float]] = []
    sender = threading.Thread(target=lambda: done.append((httpx.post(
        f"{d.url(router)}/v1/chat/completions", json=case, timeout=120), time.monotonic())))
    sender.start()
    killed_at = kill_mid_write(d, encoder)
    sender.join(timeout=120)
    (answer, answered_at), = done
    return answer, answered_at, killed_at
