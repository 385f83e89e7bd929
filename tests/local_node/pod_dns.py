"""Cluster DNS for the pods of the local node, as a hosts file every pod sees as /etc/hosts.

In a cluster, a StatefulSet pod (``spec.hostname`` and ``spec.subdomain`` set, a headless Service
of that name) is found as ``<hostname>.<subdomain>.<namespace>.svc.cluster.local``: peers.json
names decode's drafters this way. Here the node keeps one hosts file with a line per running pod
of that kind, and each pod's mount namespace bind-mounts it over /etc/hosts, so every resolver
that reads /etc/hosts (the C library's getaddrinfo: Python, ZeroMQ, gRPC's native resolver) finds
the pods. There is no kube-proxy here, so a Service's cluster IP leads nowhere; instead the name of a
Service with a cluster IP resolves to the pods it selects that the node started after it existed (a KV
store master's Service, which engines name). That holds where the Service's ports are its pods' own.

The file is rewritten in place (one write at offset 0, padded with newlines, never shortened):
a bind mount holds the inode, so replacing the file would hide every change from the pods.
"""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Mapping
from typing import Any

CLUSTER_DOMAIN = "cluster.local"


def pod_dns_names(pod: Mapping[str, Any]) -> list[str]:
    """The names cluster DNS gives a pod: none unless it has a hostname and a subdomain."""
    spec, namespace = pod.get("spec") or {}, pod["metadata"]["namespace"]
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    fqdn = f"{hostname}.{subdomain}.{namespace}.svc"
    return [f"{fqdn}.{CLUSTER_DOMAIN}", fqdn]


def service_dns_names(pod: Mapping[str, Any], services: list[Mapping[str, Any]]) -> list[str]:
    """The names of the Services (with a cluster IP: headless ones name pods instead) selecting a pod."""
    labels, namespace = pod["metadata"].get("labels") or {}, pod["metadata"]["namespace"]
    names = []
    for svc in services:
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") in (None, "None") or not selector:
            continue
        if all(labels.get(k) == v for k, v in selector.items()):
            fqdn = f"{svc['metadata']['name']}.{namespace}.svc"
            names += [f"{fqdn}.{CLUSTER_DOMAIN}", fqdn]
    return names


class HostsFile:
    """The node's hosts file: the host's own /etc/hosts, then one line per pod (its address, its names)."""

    def __init__(self, path: pathlib.Path, base: pathlib.Path = pathlib.Path("/etc/hosts")) -> None:
        self.path = path
        self._base = base.read_text() if base.exists() else "127.0.0.1 localhost\n"
        self._entries: dict[str, tuple[str, list[str]]] = {}  # pod uid -> (address, names)
        self._lock = threading.Lock()
        self._size = 0
        self._write()

    def add(self, uid: str, address: str, names: list[str]) -> None:
        if names:
            with self._lock:
                self._entries[uid] = (address, names)
                self._write()

    def remove(self, uid: str) -> None:
        with self._lock:
            if self._entries.pop(uid, None) is not None:
                self._write()

    def _write(self) -> None:
        lines = [f"{address} {' '.join(names)}\n" for address, names in self._entries.values()]
        data = (self._base.rstrip("\n") + "\n# pods of the local node\n" + "".join(lines)).encode()
        data += b"\n" * max(0, self._size - len(data))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        self._size = len(data)
