"""Fixtures: a real control plane (etcd, kube-apiserver, kube-controller-manager) for the
session, the operator as a real `splitserve operator` process, and helpers to drive them."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kubernetes
import pytest
from envtest import ControlPlane, find_assets, free_port, missing_binaries

from splitserve.operator.kube import Kube, KubeError, collection_path
from splitserve.operator.names import GROUP_API_VERSION, LABEL_GROUP

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "manifests" / "examples"
TEST_IMAGE = "example.com/splitserve:test"
# Short resync so level-based repair shows within a test; events do most of the work.
RESYNC_SECONDS = 3
# The session operator watches every namespace matching this glob.
SESSION_NAMESPACES = "op-*"
T = TypeVar("T")


class OperatorProcess:
    """`splitserve operator` as a child process, with its log in a file."""

    def __init__(self, kubeconfig: pathlib.Path, namespaces: list[str], logfile: pathlib.Path) -> None:
        self.port = free_port()
        self.logfile = logfile
        cmd = [sys.executable, "-P", "-m", "splitserve.cli", "operator", "--namespaces", *namespaces,
               "--kubeconfig", str(kubeconfig), "--liveness-host", "127.0.0.1",
               "--liveness-port", str(self.port), "--resync-seconds", str(RESYNC_SECONDS),
               "--default-image", TEST_IMAGE]
        with open(logfile, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait_alive()

    def wait_alive(self, timeout: float = 60.0) -> None:
        """Waits for the liveness endpoint to answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"operator not alive after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the operator's log."""
        return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, as a crash or an evicted pod."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """What the tests drive: the control plane, an admin API client, kubectl and operators."""

    def __init__(self, control_plane: ControlPlane, workdir: pathlib.Path) -> None:
        self.cp = control_plane
        self.workdir = workdir
        self.api = kubernetes.config.new_client_from_config(config_file=str(control_plane.kubeconfig))
        self.kube = Kube(self.api, field_manager="tests")
        self.operators: list[OperatorProcess] = []

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl as the cluster admin."""
        return self.cp.kubectl(*args, input=input, check=check)

    def namespace(self, prefix: str) -> str:
        """Creates a fresh namespace and returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        return name

    def start_operator(self, namespaces: list[str], kubeconfig: pathlib.Path | None = None) -> OperatorProcess:
        """Starts a `splitserve operator` process watching ``namespaces``."""
        op = OperatorProcess(kubeconfig or self.cp.kubeconfig, namespaces,
                             self.workdir / f"operator-{len(self.operators)}.log")
        self.operators.append(op)
        return op

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """An object or None."""
        return self.kube.get(api_version, kind, namespace, name)

    def group(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ServingGroup or None."""
        return self.get(GROUP_API_VERSION, "ServingGroup", namespace, name)

    def children(self, namespace: str, group: str) -> dict[str, list[dict[str, Any]]]:
        """Every object labelled with the group, by kind."""
        labels = {LABEL_GROUP: group}
        return {kind: self.kube.list(api_version, kind, namespace, labels) for api_version, kind in (
            (GROUP_API_VERSION, "ServingRole"), ("apps/v1", "StatefulSet"), ("v1", "Service"),
            ("apps/v1", "Deployment"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Pod"),
            ("networking.k8s.io/v1", "NetworkPolicy"))}

    def mark_pods_ready(self, namespace: str) -> int:
        """Does the kubelet's part: every pod of the namespace becomes Running and Ready."""
        marked = 0
        for pod in self.kube.list("v1", "Pod", namespace):
            if pod["metadata"].get("deletionTimestamp"):
                continue
            conditions = (pod.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                continue
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status = {"phase": "Running", "podIP": "10.1.0.1", "startTime": now, "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("Initialized", "ContainersReady", "Ready", "PodScheduled")]}
            try:
                self.kube.request("PATCH", f"{collection_path('v1', 'Pod', namespace)}/"
                                  f"{pod['metadata']['name']}/status", body={"status": status},
                                  content_type="application/merge-patch+json")
                marked += 1
            except KubeError as exc:
                if exc.status not in (404, 409):
                    raise
        return marked

    def wait_for(self, check: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.3,
                 ready_pods_in: str | None = None) -> T:
        """Polls ``check`` until it returns something truthy; optionally marks pods ready meanwhile."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if ready_pods_in:
                self.mark_pods_ready(ready_pods_in)
            last = check()
            if last:
                return last
            time.sleep(interval)
        logs = "\n".join(op.log_tail() for op in self.operators if op.proc.poll() is None)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}\n"
                             f"operator log:\n{logs}")

    def apply_yaml(self, namespace: str, text: str) -> subprocess.CompletedProcess[str]:
        """kubectl apply of a YAML document into ``namespace``."""
        return self.kubectl("apply", "-n", namespace, "-f", "-", input=text)

    @staticmethod
    def example(name: str) -> str:
        """The text of manifests/examples/<name>.yaml."""
        return (EXAMPLES / f"{name}.yaml").read_text()

    @staticmethod
    def env_map(container: dict[str, Any]) -> dict[str, Any]:
        """A container's env as name -> value (or valueFrom)."""
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}

    def condition(self, namespace: str, group: str, type_: str) -> dict[str, Any]:
        """One condition of a group's status ({} when absent)."""
        status = (self.group(namespace, group) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager for the whole session, CRDs installed."""
    assets = find_assets()
    if assets is None:
        pytest.skip("no Kubernetes binaries: set KUBEBUILDER_ASSETS or run scripts/k8s_assets.sh")
    missing = missing_binaries(assets)
    if missing:
        pytest.fail(f"KUBEBUILDER_ASSETS={assets} lacks {', '.join(missing)}")
    cp = ControlPlane(assets, tmp_path_factory.mktemp("k8s"))
    try:
        cp.start(before_controllers=[REPO / "manifests" / "crds"])
    except BaseException:
        cp.stop()
        raise
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Helpers over the session's control plane; stops the operators tests started."""
    c = Cluster(control_plane, tmp_path_factory.mktemp("operators"))
    yield c
    for op in c.operators:
        op.stop()


@pytest.fixture(scope="session")
def operator(cluster: Cluster) -> OperatorProcess:
    """One operator for the session, watching every namespace named op-*."""
    return cluster.start_operator([SESSION_NAMESPACES])
