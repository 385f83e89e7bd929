"""An engine pod's preStop hook: wait until the engine has nothing in flight, so a scale-down loses no request.

``python3 -m splitserve.operator.prestop --port 8000 --settle 5 --timeout 110`` (stdlib only: it runs in the
engine's container). What happens when a role is scaled down (the StatefulSet deletes its highest ordinals):

1. The pod gets its deletion timestamp. The endpoints controller drops it from the Endpoints of the role's
   *serving* Service (``<role>-serving``: ready pods only, not ``publishNotReadyAddresses``); the router watches
   those Endpoints and stops sending the pod new requests, while its requests in flight go on (the router drains a
   backend that left: ``router/backend_pool.py``).
2. The kubelet runs this hook before any signal. It waits ``--settle`` seconds (the Endpoints change reaching the
   router), then polls the engine's own ``/metrics`` until ``splitserve_requests_running`` and
   ``splitserve_requests_waiting`` are both 0 on two polls in a row, or ``--timeout`` passes.
3. The hook returns; the kubelet sends SIGTERM, and the engine's uvicorn shuts down gracefully with nothing left
   to cut. ``terminationGracePeriodSeconds`` (the role's ``drainSeconds`` + 10) bounds the whole, hook included.

A prefill pod holds a request until its KV pages are sent (it counts as running until then), a decode pod until
its last token. The hook always exits 0: a failing hook would only delay the SIGTERM to the end of the grace period.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request

BUSY_GAUGES = ("splitserve_requests_running", "splitserve_requests_waiting")


def in_flight(metrics_text: str) -> float:
    """Requests running or waiting, from an engine's Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_GAUGES:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, settle_s: float, timeout_s: float, poll_s: float = 0.5,
              clock=time.monotonic, sleep=time.sleep, fetch=None) -> str:
    """Waits as described in the module's docstring; returns how it ended (``idle``, ``timeout``, ``gone``)."""
    def get(address: str) -> str:
        with urllib.request.urlopen(address, timeout=2.0) as response:
            return response.read().decode()

    fetch = fetch or get
    deadline = clock() + timeout_s
    sleep(min(settle_s, timeout_s))
    quiet = 0
    while clock() < deadline:
        try:
            busy = in_flight(fetch(url))
        except OSError:
            return "gone"  # the engine is not answering: nothing left to wait for
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return "idle"
        sleep(poll_s)
    return "timeout"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m splitserve.operator.prestop", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="the engine's HTTP port")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds for the pod's removal from Endpoints to reach the router")
    parser.add_argument("--timeout", type=float, default=110.0, help="most seconds to wait in all")
    args = parser.parse_args(argv)
    how = wait_idle(f"http://127.0.0.1:{args.port}/metrics", args.settle, args.timeout)
    print(f"preStop: {how}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
