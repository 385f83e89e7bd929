"""The router's view of its group in Kubernetes: the Endpoints of the group's role Services.

The operator labels each role's headless Service with ``splitserve.io/group`` and
``splitserve.io/role``; the endpoints controller copies those labels onto the Service's
Endpoints. One watch on the Endpoints of the router's group gives, per role, the URL of every
pod (its address and the port named ``http``); each change of that map goes to a callback.
Scaling a role thus changes the router's backends without restarting it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LABEL_GROUP = "splitserve.io/group"
LABEL_ROLE = "splitserve.io/role"
HTTP_PORT_NAME = "http"
RETRY_DELAY_S = 1.0
# role -> sorted URLs of its pods
RoleUrls = dict[str, list[str]]


class WatchExpired(Exception):
    """The watch's resource version is too old (HTTP 410): list again."""


@dataclass(frozen=True)
class InClusterAccess:
    """How a pod reaches the API server: its Service address and the pod's service-account token."""

    server: str
    token_file: Path
    ca_file: Path

    @classmethod
    def from_pod(cls, account_dir: Path = SERVICE_ACCOUNT_DIR) -> InClusterAccess:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise RuntimeError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST/PORT are not set")
        if not (account_dir / "token").is_file():
            raise RuntimeError(f"no service-account token in {account_dir} (automountServiceAccountToken off?)")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", account_dir / "token", account_dir / "ca.crt")

    def client(self) -> httpx.AsyncClient:
        """A client for the API server; the token is read anew for each client (tokens rotate)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        token = self.token_file.read_text().strip()
        return httpx.AsyncClient(base_url=self.server, verify=context, headers={"Authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(10.0, read=90.0))


def role_urls(endpoints: Mapping[str, Mapping[str, Any]]) -> RoleUrls:
    """Per role, the URL of every address of the given Endpoints objects (by name)."""
    urls: dict[str, set[str]] = {}
    for obj in endpoints.values():
        role = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE)
        if not role:
            continue
        found = urls.setdefault(role, set())
        for subset in obj.get("subsets") or []:
            port = next((p["port"] for p in subset.get("ports") or [] if p.get("name") == HTTP_PORT_NAME), None)
            if port is None:
                continue
            for address in subset.get("addresses") or []:
                found.add(f"http://{address['ip']}:{port}")
    return {role: sorted(found) for role, found in urls.items()}


class EndpointsWatch:
    """Lists, then watches the Endpoints of one group; calls ``on_change(role_urls)`` on each change."""

    def __init__(self, access: InClusterAccess, namespace: str, group: str,
                 on_change: Callable[[RoleUrls], None]) -> None:
        self.access, self.namespace, self.group, self.on_change = access, namespace, group, on_change
        self.path = f"/api/v1/namespaces/{namespace}/endpoints"
        self.selector = f"{LABEL_GROUP}={group}"
        self._objects: dict[str, dict[str, Any]] = {}
        self._published: RoleUrls | None = None

    async def run(self) -> None:
        """Runs until cancelled; a failed list or watch is retried after a second."""
        while True:
            try:
                async with self.access.client() as client:
                    version = await self._list(client)
                    while True:
                        version = await self._watch(client, version)
            except asyncio.CancelledError:
                raise
            except WatchExpired:
                logger.info("endpoints watch of group %s expired; listing again", self.group)
            except (httpx.HTTPError, OSError, RuntimeError, ValueError, KeyError) as exc:
                logger.warning("endpoints watch of group %s/%s failed (%s); retrying", self.namespace,
                               self.group, exc)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _list(self, client: httpx.AsyncClient) -> str:
        r = await client.get(self.path, params={"labelSelector": self.selector})
        if r.status_code != 200:
            raise RuntimeError(f"listing {self.path}: HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        self._objects = {o["metadata"]["name"]: o for o in body.get("items") or []}
        self._publish()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, client: httpx.AsyncClient, version: str) -> str:
        """One watch request, until the server ends it; returns the last resource version seen."""
        params = {"labelSelector": self.selector, "watch": "true", "resourceVersion": version,
                  "timeoutSeconds": "60", "allowWatchBookmarks": "true"}
        async with client.stream("GET", self.path, params=params) as r:
            if r.status_code == 410:
                raise WatchExpired()
            if r.status_code != 200:
                raise RuntimeError(f"watching {self.path}: HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = str(obj["metadata"]["resourceVersion"])
                if event["type"] == "DELETED":
                    self._objects.pop(obj["metadata"]["name"], None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self._objects[obj["metadata"]["name"]] = obj
                self._publish()
        return version

    def _publish(self) -> None:
        urls = role_urls(self._objects)
        if urls != self._published:
            self._published = urls
            logger.info("group %s backends: %s", self.group, urls)
            self.on_change(urls)
