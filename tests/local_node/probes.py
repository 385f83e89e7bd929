"""Container probes (httpGet, tcpSocket, exec) with the kubelet's timing fields."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def container_port(container: Mapping[str, Any], port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port!r}")


def probe_once(probe: Mapping[str, Any], container: Mapping[str, Any], pod_ip: str,
               env: Mapping[str, str]) -> bool:
    """One attempt of a probe: whether it succeeded within its timeout."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            conn = http.client.HTTPConnection(get.get("host") or pod_ip, container_port(container, get["port"]),
                                              timeout=timeout)
            try:
                conn.request("GET", get.get("path", "/"),
                             headers={h["name"]: h["value"] for h in get.get("httpHeaders") or []})
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            with socket.create_connection((tcp.get("host") or pod_ip, container_port(container, tcp["port"])),
                                          timeout=timeout):
                return True
        if "exec" in probe:
            return subprocess.run(probe["exec"]["command"], env=dict(env), timeout=timeout,
                                  capture_output=True).returncode == 0
    except (OSError, ValueError, http.client.HTTPException, subprocess.TimeoutExpired):
        return False
    raise ValueError(f"probe of container {container['name']} has no handler: {dict(probe)}")


@dataclass
class ProbeState:
    """One probe of one running container: when it is due and its consecutive outcomes."""

    spec: Mapping[str, Any]
    started_at: float
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    # None until the thresholds decide; then the probe's verdict (ready / alive / started).
    passing: bool | None = None

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.spec.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        """Counts one outcome against successThreshold / failureThreshold."""
        self.next_at = now + float(self.spec.get("periodSeconds", 10))
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.passing = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.passing = False


def new_probe(container: Mapping[str, Any], kind: str, started_at: float | None = None) -> ProbeState | None:
    """The state of a container's ``<kind>Probe`` (startup, readiness, liveness), or None."""
    spec = container.get(f"{kind}Probe")
    return ProbeState(spec, time.monotonic() if started_at is None else started_at) if spec else None
