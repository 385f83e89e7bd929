"""The SLO planner in a running operator, against a real API server: a group with spec.slo.enabled whose pods'
/metrics are served by fake engines and a fake router on loopback addresses (their pods' IPs, patched in as a
kubelet would). The planner scrapes them, scales prefill up through the ServingRole's scale subresource when TTFT
breaches, back down when the load is gone, and shows what it saw and why in status.planner and kubectl get."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest

from splitserve.engine.metrics import EngineMetrics
from splitserve.operator.kube import KubeError, collection_path
from splitserve.operator.names import GROUP_API_VERSION

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ADDRESSES = {"prefill": "127.0.0.62", "decode": "127.0.0.63", "router": "127.0.0.64"}
ROUTER_PORT = 18064


class FakeTargets:
    """An engine's or router's /metrics, whose counters the test advances."""

    def __init__(self) -> None:
        self.engines = {role: EngineMetrics("tiny") for role in ("prefill", "decode")}
        self.router_registry = CollectorRegistry()
        self.requests = Counter("splitserve_router_requests", "x", ["outcome"], registry=self.router_registry)
        self.servers: list[http.server.ThreadingHTTPServer] = []

    def serve(self, host: str, port: int, registry: CollectorRegistry) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)

    def load(self, requests: int, ttft: float) -> None:
        """``requests`` more requests of 300 prompt and 20 output tokens, with this TTFT."""
        self.requests.labels("ok").inc(requests)
        for role, m in self.engines.items():
            for _ in range(requests):
                m.ttft.observe(ttft)
                m.finished("stop")
            if role == "prefill":
                m.prompt_tokens.inc(300 * requests)
            else:
                m.generation_tokens.inc(20 * requests)
                for _ in range(requests):
                    m.itl.observe(0.01)


@pytest.fixture
def targets() -> Iterator[FakeTargets]:
    fake = FakeTargets()
    try:
        fake.serve(ADDRESSES["prefill"], 8000, fake.engines["prefill"].registry)
        fake.serve(ADDRESSES["decode"], 8000, fake.engines["decode"].registry)
        fake.serve(ADDRESSES["router"], ROUTER_PORT, fake.router_registry)
    except OSError as exc:
        for server in fake.servers:
            server.shutdown()
        pytest.skip(f"cannot listen on the fake pods' addresses: {exc}")
    yield fake
    for server in fake.servers:
        server.shutdown()
        server.server_close()


GROUP = """
apiVersion: splitserve.io/v1alpha1
kind: ServingGroup
metadata:
  name: planned
spec:
  model: {name: tiny, imagePath: /opt/models/tiny}
  roles:
    prefill: {replicas: 1}
    decode: {replicas: 1}
  router: {port: ROUTER_PORT}
  slo:
    enabled: true
    ttftSeconds: 0.5
    itlSeconds: 0.05
    percentile: 90
    intervalSeconds: 5
    startupSeconds: 0
    scaleDownIntervals: 1
    roles:
      prefill: {minReplicas: 1, maxReplicas: 3}
      decode: {minReplicas: 1, maxReplicas: 2}
""".replace("ROUTER_PORT", str(ROUTER_PORT))


def mark_ready_at(cluster: Any, namespace: str) -> None:
    """The kubelet's part: each pod Running and Ready, its IP the fake address of its role."""
    for pod in cluster.kube.list("v1", "Pod", namespace):
        meta = pod["metadata"]
        role = (meta.get("labels") or {}).get("splitserve.io/role")
        if meta.get("deletionTimestamp") or role not in ADDRESSES:
            continue
        if (pod.get("status") or {}).get("podIP") == ADDRESSES[role]:
            continue
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"phase": "Running", "podIP": ADDRESSES[role], "startTime": now, "conditions": [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "ContainersReady", "Ready", "PodScheduled")]}
        try:
            cluster.kube.request("PATCH", f"{collection_path('v1', 'Pod', namespace)}/{meta['name']}/status",
                                 body={"status": status}, content_type="application/merge-patch+json")
        except KubeError as exc:
            if exc.status not in (404, 409):
                raise


def test_the_planner_scales_prefill_up_on_a_ttft_breach_and_down_when_idle(cluster: Any,
                                                                          targets: FakeTargets) -> None:
    ns = cluster.namespace("planner")
    operator = cluster.start_operator([ns])
    cluster.apply_yaml(ns, GROUP)

    def role_replicas(role: str) -> int:
        return int(cluster.get(GROUP_API_VERSION, "ServingRole", ns, f"planned-{role}")["spec"]["replicas"])

    def planner() -> dict[str, Any]:
        return ((cluster.group(ns, "planned") or {}).get("status") or {}).get("planner") or {}

    def with_pods_ready(check: Any) -> Any:
        def run() -> Any:
            mark_ready_at(cluster, ns)
            return check()
        return run

    cluster.wait_for(with_pods_ready(lambda: planner().get("lastRunTime")), "the planner's first run", timeout=60)
    # Slow first tokens (2 s against 0.5 s), 10 requests an interval: prefill is blamed (KV is idle).
    stop = threading.Event()

    def keep_loading() -> None:
        while not stop.is_set():
            targets.load(10, 2.0)
            stop.wait(1.0)

    loader = threading.Thread(target=keep_loading, daemon=True)
    loader.start()
    try:
        cluster.wait_for(with_pods_ready(lambda: role_replicas("prefill") >= 2), "prefill scaled up", timeout=90)
    finally:
        stop.set()
        loader.join()
    status = cluster.wait_for(lambda: planner() if "prefill 1 -> " in planner().get("lastDecision", "") else None,
                              "the decision in status.planner", timeout=30)
    assert "scale up" in status["lastDecision"], status
    assert status["observed"]["ttftSeconds"] > 0.5 and status["observed"]["arrivalRate"] > 0
    assert status["observed"]["promptTokens"] == pytest.approx(300)
    assert status["desired"].split(":")[0] == str(role_replicas("prefill"))
    # The group never undoes the planner's scale (it pushes spec.roles.prefill.replicas only when that changes).
    group = cluster.wait_for(with_pods_ready(
        lambda: (g := cluster.group(ns, "planned")) and g["status"].get("desiredPD", "").startswith(
            f"{role_replicas('prefill')}:") and g), "desiredPD in the group's status", timeout=30)
    assert group["spec"]["roles"]["prefill"]["replicas"] == 1
    table = cluster.kubectl("get", "sg", "planned", "-n", ns, "-o", "wide").stdout
    assert "P:D" in table.splitlines()[0] and "DESIRED P:D" in table.splitlines()[0], table

    # No load, fast first tokens: back down to the minimum after scaleDownIntervals (1).
    # The planner scales first and writes status.planner after, so wait for both: replicas at 1 alone can be seen
    # before the status of the run that made it.
    cluster.wait_for(with_pods_ready(lambda: role_replicas("prefill") == 1), "prefill scaled down", timeout=90)
    cluster.wait_for(lambda: "-> 1: scale down" in planner().get("lastDecision", ""),
                     "the scale-down in status.planner", timeout=30)
    assert role_replicas("prefill") == 1
    assert "Traceback" not in operator.log_tail(200)


def test_a_group_without_slo_is_never_planned(cluster: Any) -> None:
    ns = cluster.namespace("unplanned")
    cluster.start_operator([ns])
    doc = yaml.safe_load(GROUP)
    doc["metadata"]["name"] = "static"
    doc["spec"]["slo"]["enabled"] = False
    cluster.apply_yaml(ns, yaml.safe_dump(doc))
    cluster.wait_for(lambda: (cluster.group(ns, "static") or {}).get("status", {}).get("desiredPD") == "1:1",
                     "the group reconciled", timeout=60)
    time.sleep(7)
    assert "planner" not in cluster.group(ns, "static")["status"]
