"""`up`'s liveness checks on real processes (small HTTP servers standing in for engines): a process that answers
503 is stopped and restarted once it has been healthy, or once a restart has not become healthy within the
startup timeout; one that does not answer at all holds up no other process's checks."""

from __future__ import annotations

import socket
import sys
import time

from splitserve.launcher.up import Child, Deployment, UpConfig

# Answers /health with the status given on its command line, on the port given; `hang` accepts and never replies.
SERVER = """
import http.server, socket, sys, time
port, status = int(sys.argv[1]), sys.argv[2]
if status == "hang":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", port))
    s.listen(16)
    held = []
    while True:
        held.append(s.accept()[0])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(status)); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"no")
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(name: str, status: str) -> Child:
    port = free_port()
    return Child(name, f"http://127.0.0.1:{port}", [], command=[sys.executable, "-c", SERVER, str(port), status])


def supervise_until(deployment: Deployment, done, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, [(c.name, c.restarts, c.liveness_failures) for c in deployment.children]
        deployment.supervise_once()
        time.sleep(0.05)


def test_a_process_answering_503_is_restarted_once_healthy_or_past_its_startup_timeout() -> None:
    cfg = UpConfig(liveness_period_s=0.2, liveness_failures=2, startup_timeout_s=1.5, restart_backoff_s=0.1)
    deployment = Deployment(cfg)
    failing, hanging, fine = child("failing", "503"), child("hanging", "hang"), child("fine", "200")
    deployment.children = [failing, hanging, fine]
    try:
        for c in deployment.children:
            deployment._spawn(c)
        failing.healthy = True  # as start() marks every process it saw healthy
        started = time.monotonic()
        supervise_until(deployment, lambda: failing.restarts >= 1)
        assert time.monotonic() - started < 5  # two failed checks 0.2 s apart, then the backoff
        # The restarted one never answers 200: it is stopped again once past --startup-timeout-s.
        supervise_until(deployment, lambda: failing.restarts >= 2)
        assert fine.healthy and fine.restarts == 0 and fine.liveness_failures == 0  # checked all along
        # The one that accepts and never answers is restarted too, past its startup timeout.
        supervise_until(deployment, lambda: hanging.restarts >= 1)
    finally:
        deployment.stop()
    assert all(c.proc is not None and c.proc.poll() is not None for c in deployment.children)
