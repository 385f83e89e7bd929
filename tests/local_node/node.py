"""The local node: a Node object, a watch on the pods bound to it, and what it does with them."""

from __future__ import annotations

import ipaddress
import logging
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from local_node.pod_dns import HostsFile, pod_dns_names, service_dns_names
from local_node.pod_worker import PodContext, PodWorker, rfc3339
from splitserve.operator.kube import Kube, KubeError, collection_path, watch_events

log = logging.getLogger(__name__)
SITE = pathlib.Path(__file__).parent / "pod_site"
# The image's entrypoint: the pods' `splitserve ...` runs this machine's console script.
LOCAL_SPLITSERVE = [sys.executable, "-P", "-m", "splitserve.cli"]
# Host variables a process needs to run here at all (what the image would provide).
IMAGE_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "XDG_CACHE_HOME", "HF_HOME")
# gRPC's default (c-ares) resolver asks DNS servers only; the native one reads /etc/hosts, where
# the node puts the pods' cluster DNS names (pod_dns.py).
POD_ENV = {"GRPC_DNS_RESOLVER": "native"}


@dataclass
class NodeCapacity:
    """What the node offers the scheduler."""

    cpu: str = "16"
    memory: str = "64Gi"
    gpus: int = 8
    pods: int = 110

    def resources(self) -> dict[str, str]:
        return {"cpu": self.cpu, "memory": self.memory, "nvidia.com/gpu": str(self.gpus), "pods": str(self.pods),
                "ephemeral-storage": "100Gi"}


class PodAddresses:
    """Pod IPs handed out one per pod from a range, never reused.

    Not 127.0.0.0/8: the API server refuses loopback addresses in Endpoints, and the router
    finds its engines through them. Instead the whole range is made local to this machine, as
    127.0.0.0/8 is, by one route (``ip route add local 10.244.0.0/16 dev lo``): a process can
    bind any address of it and every process here reaches it over the loopback device.
    """

    def __init__(self, network: str = "10.244.0.0/16") -> None:
        self.network = ipaddress.ip_network(network)
        self._next, self._last = int(self.network.network_address) + 2, int(self.network.broadcast_address) - 1
        self._lock = threading.Lock()
        self._route_added = False

    def route_locally(self) -> None:
        """Adds the local route for the range (once; a route already there is left as it is)."""
        shown = subprocess.run(["ip", "route", "show", "table", "local", str(self.network)], capture_output=True,
                               text=True, check=True).stdout
        if not shown.strip():
            subprocess.run(["ip", "route", "add", "local", str(self.network), "dev", "lo"], check=True)
            self._route_added = True

    def unroute(self) -> None:
        """Removes the route if :meth:`route_locally` added it."""
        if self._route_added:
            subprocess.run(["ip", "route", "del", "local", str(self.network), "dev", "lo"], check=False)
            self._route_added = False

    def take(self) -> str:
        with self._lock:
            if self._next > self._last:
                raise RuntimeError("the local node ran out of pod addresses")
            address = str(ipaddress.ip_address(self._next))
            self._next += 1
            return address


@dataclass
class LocalNode:
    """Registers a Node and plays its kubelet.

    ``run_pods``: run the containers as local processes; otherwise only mark each pod Running
    and Ready with an address (for scale tests). ``known_images``: images whose ``splitserve``
    entrypoint maps to this machine's console script; a pod naming another waits in ErrImagePull.
    """

    kube: Kube
    name: str
    workdir: pathlib.Path
    api_host: str
    api_port: int
    capacity: NodeCapacity = field(default_factory=NodeCapacity)
    addresses: PodAddresses = field(default_factory=PodAddresses)
    run_pods: bool = True
    known_images: frozenset[str] = frozenset()
    restart_backoff_s: float = 10.0
    simulated_writers: int = 4
    workers: dict[tuple[str, str], PodWorker] = field(default_factory=dict)
    simulated: dict[str, str] = field(default_factory=dict)  # pod uid -> its address

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._writes: queue.Queue[tuple[str, Mapping[str, Any]] | None] = queue.Queue()
        self._writers: list[threading.Thread] = []
        self.hosts: HostsFile | None = None

    # Node ------------------------------------------------------------------------------------

    def start(self) -> LocalNode:
        """Registers the Node and starts watching the pods bound to it."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "splitserve.io/local-node": "true"}}}
        try:
            self.kube.request("POST", "/api/v1/nodes", body=node)
        except KubeError as exc:
            if exc.status != 409:
                raise
        now = rfc3339()
        status = {"capacity": self.capacity.resources(), "allocatable": self.capacity.resources(),
                  "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname",
                                                                                  "address": self.name}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "local node", "lastHeartbeatTime": now, "lastTransitionTime": now}],
                  "nodeInfo": {"kubeletVersion": "v1.20.2-local", "operatingSystem": "linux",
                               "architecture": "amd64", "containerRuntimeVersion": "local://processes",
                               "kernelVersion": "", "osImage": "", "kubeProxyVersion": "", "machineID": "",
                               "systemUUID": "", "bootID": ""}}
        self.kube.request("PATCH", f"/api/v1/nodes/{self.name}/status", body={"status": status},
                          content_type="application/merge-patch+json")
        # The API server taints a new Node not-ready; the node lifecycle controller (not run here)
        # would lift the taint once the Node reports Ready, as it now does.
        self.kube.request("PATCH", f"/api/v1/nodes/{self.name}", body={"spec": {"taints": None}},
                          content_type="application/merge-patch+json")
        if self.run_pods:
            self.addresses.route_locally()
            self.hosts = HostsFile(self.workdir / "hosts")
        else:
            self._writers = [threading.Thread(target=self._write_simulated, daemon=True, name=f"sim-writer-{i}")
                             for i in range(self.simulated_writers)]
            for t in self._writers:
                t.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name=f"node-{self.name}")
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stops every pod's processes (SIGTERM, then SIGKILL) and removes the Node."""
        self._stop.set()
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.update(worker.pod, gone=True)
        for worker in workers:
            worker.join(timeout=90)
        for _ in self._writers:
            self._writes.put(None)
        self.addresses.unroute()
        try:
            self.kube.request("DELETE", f"/api/v1/nodes/{self.name}")
        except KubeError as exc:
            if exc.status != 404:
                raise

    def worker(self, namespace: str, name: str) -> PodWorker | None:
        """The worker of a pod running here."""
        with self._lock:
            return self.workers.get((namespace, name))

    def running_pids(self) -> list[int]:
        """Process ids of every container running on this node."""
        with self._lock:
            workers = list(self.workers.values())
        return [run.proc.pid for w in workers for run in w.containers if run.running]  # type: ignore[union-attr]

    # Watch -------------------------------------------------------------------------------------

    def _watch(self) -> None:
        selector = f"spec.nodeName={self.name}"
        while not self._stop.is_set():
            try:
                listed = self.kube.request("GET", "/api/v1/pods", query=[("fieldSelector", selector)])
                self._forget_missing({p["metadata"]["uid"] for p in listed.get("items", [])})
                for pod in listed.get("items", []):
                    self._on_pod("ADDED", pod)
                version = listed["metadata"]["resourceVersion"]
                while not self._stop.is_set():  # each watch ends after its timeout; go on from there
                    for kind, pod in watch_pods(self.kube, "/api/v1/pods", selector, version, self._stop):
                        version = pod["metadata"]["resourceVersion"]
                        if kind != "BOOKMARK":
                            self._on_pod(kind, pod)
            except Exception as exc:
                if not self._stop.is_set():
                    log.warning("node %s: pod watch failed (%s); listing again", self.name, exc)
                    time.sleep(0.5)

    def _forget_missing(self, uids: set[str]) -> None:
        """After a fresh list: pods whose deletion the watch missed are gone."""
        with self._lock:
            workers = [w for w in self.workers.values() if w.pod["metadata"]["uid"] not in uids]
        for worker in workers:
            worker.update(worker.pod, gone=True)
        for uid in set(self.simulated) - uids:
            self.simulated.pop(uid, None)

    def _on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        if self._stop.is_set():
            return
        meta = pod["metadata"]
        if not self.run_pods:
            self._on_simulated_pod(kind, pod)
            return
        key = (meta["namespace"], meta["name"])
        with self._lock:
            worker = self.workers.get(key)
            if worker is not None and worker.pod["metadata"]["uid"] != meta["uid"]:
                worker = None  # a new pod of the same name (StatefulSet): its own worker
            if worker is None:
                if kind == "DELETED":
                    return
                worker = PodWorker(pod, self._context(pod), self._write_status, self._finish_deletion)
                self.workers[key] = worker
                worker.start()
                return
        worker.update(pod, gone=kind == "DELETED")

    def _context(self, pod: Mapping[str, Any]) -> PodContext:
        meta = pod["metadata"]
        folder = self.workdir / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        pod_ip = self.addresses.take()
        base = {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
        base["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [base.get("PYTHONPATH")])])
        base.update(POD_ENV)
        if self.hosts is not None:
            services = self.kube.list("v1", "Service", meta["namespace"])
            self.hosts.add(meta["uid"], pod_ip, pod_dns_names(pod) + service_dns_names(pod, services))
        base.update({"HOSTNAME": meta["name"], "LOCAL_NODE_POD_IP": pod_ip,
                     # What the kubelet tells every pod: the API server (its Service, here reached directly).
                     "KUBERNETES_SERVICE_HOST": self.api_host, "KUBERNETES_SERVICE_PORT": str(self.api_port),
                     "KUBERNETES_SERVICE_PORT_HTTPS": str(self.api_port)})
        return PodContext(pod_ip=pod_ip, host_ip="127.0.0.1", folder=folder, lookup=self._lookup, base_env=base,
                          entrypoints={"splitserve": LOCAL_SPLITSERVE}, known_images=self.known_images,
                          restart_backoff_s=self.restart_backoff_s,
                          hosts_file=self.hosts.path if self.hosts is not None else None)

    def _lookup(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get("v1", kind, namespace, name)

    def _write_status(self, pod: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self.kube.request("PATCH", f"{collection_path('v1', 'Pod', meta['namespace'])}/{meta['name']}/status",
                              body={"metadata": {"uid": meta["uid"]}, "status": dict(status)},
                              content_type="application/merge-patch+json")
        except KubeError as exc:
            if exc.status not in (404, 409):
                log.warning("status of pod %s/%s: %s", meta["namespace"], meta["name"], exc)

    def _finish_deletion(self, pod: Mapping[str, Any], delete_object: bool = True) -> None:
        """The kubelet's last word on a deleted pod: its containers are gone, remove the object."""
        meta = pod["metadata"]
        if self.hosts is not None:
            self.hosts.remove(meta["uid"])  # before the object goes: a new pod of the name may follow
        try:
            if delete_object:
                self.kube.request("DELETE", f"{collection_path('v1', 'Pod', meta['namespace'])}/{meta['name']}",
                                  body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except KubeError as exc:
            if exc.status not in (404, 409):
                raise
        with self._lock:
            if self.workers.get((meta["namespace"], meta["name"])) is not None and \
                    self.workers[(meta["namespace"], meta["name"])].pod["metadata"]["uid"] == meta["uid"]:
                del self.workers[(meta["namespace"], meta["name"])]

    # Simulated pods ------------------------------------------------------------------------------

    def _on_simulated_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        if kind == "DELETED":
            self.simulated.pop(meta["uid"], None)
            return
        if meta.get("deletionTimestamp"):
            self._writes.put(("delete", pod))
            return
        if meta["uid"] not in self.simulated:
            self.simulated[meta["uid"]] = self.addresses.take()
            self._writes.put(("ready", pod))

    def _write_simulated(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            what, pod = item
            try:
                if what == "delete":
                    self._finish_deletion(pod)
                    continue
                now, ip = rfc3339(), self.simulated.get(pod["metadata"]["uid"])
                if ip is None:
                    continue
                conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                              for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]
                self._write_status(pod, {
                    "phase": "Running", "conditions": conditions, "hostIP": "127.0.0.1", "podIP": ip,
                    "podIPs": [{"ip": ip}], "startTime": now,
                    "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "imageID": "",
                                           "ready": True, "started": True, "restartCount": 0,
                                           "state": {"running": {"startedAt": now}}}
                                          for c in pod["spec"]["containers"]]})
            except Exception as exc:
                log.warning("simulated pod %s: %s", pod["metadata"]["name"], exc)


def watch_pods(kube: Kube, path: str, field_selector: str, version: str,
               stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, pod) of a watch from ``version`` on, bookmarks included; ends when the server closes it
    (after its timeout) or on ``stop``; raises :class:`KubeError` when the version is too old (410)."""
    query = [("watch", "true"), ("fieldSelector", field_selector), ("resourceVersion", version),
             ("timeoutSeconds", "30"), ("allowWatchBookmarks", "true")]
    return watch_events(kube.api, path, query, stop, (5, 45))
