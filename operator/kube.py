"""A small typed layer over the Kubernetes REST API for the kinds the operator writes.

The generated ``kubernetes`` client does the TLS and authentication; this module maps a kind
to its URL and applies desired objects: create when absent, replace when what the operator
last wrote (a hash kept in an annotation) or any field it sets has changed, else nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient

from splitserve.operator.names import (
    ANNOTATION_APPLIED_HASH,
    GROUP_API_VERSION,
    GROUP_PLURAL,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    MANAGED_BY,
    ROLE_PLURAL,
)
from splitserve.operator.rollout import stable_hash

log = logging.getLogger(__name__)

# (apiVersion, kind) -> plural, for every kind the operator reads or writes.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Endpoints"): "endpoints",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    (GROUP_API_VERSION, "ServingGroup"): GROUP_PLURAL,
    (GROUP_API_VERSION, "ServingRole"): ROLE_PLURAL,
}
# Top-level fields of a kind that the operator writes once and never replaces: the Secret's
# random key must survive every reconcile.
WRITE_ONCE: dict[str, tuple[str, ...]] = {"Secret": ("data",)}


class KubeError(RuntimeError):
    """An API call failed; carries the HTTP status and the server's message."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """URL path of a kind's collection in a namespace."""
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def watch_events(api: ApiClient, path: str, query: list[tuple[str, str]], stop: threading.Event,
                 request_timeout: tuple[float, float]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, object) of one watch request (`query` holds watch=true, the resourceVersion, selectors
    and timeoutSeconds); ends when the server closes it (after its timeout) or on `stop`; raises
    :class:`KubeError` on a status >= 400 and on an ERROR event (410: the version is too old)."""
    method, url, headers, body, post = api.param_serialize(
        method="GET", resource_path=path, query_params=query, header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"])
    response = api.call_api(method, url, header_params=headers, body=body, post_params=post,
                            _request_timeout=request_timeout).response
    try:
        if response.status >= 400:
            raise KubeError("WATCH", path, response.status, response.read().decode(errors="replace")[:300])
        buffer = b""
        for chunk in response.stream(64 * 1024, decode_content=True):
            if stop.is_set():
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise KubeError("WATCH", path, int(event["object"].get("code", 500)),
                                    event["object"].get("message", ""))
                yield event["type"], event["object"]
    finally:
        response.release_conn()


@dataclass
class Kube:
    """Blocking calls to the API server through a configured ``kubernetes.client.ApiClient``."""

    api: ApiClient
    field_manager: str = "splitserve-operator"

    def request(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        """One API call; returns the decoded JSON body, raises :class:`KubeError` on >= 400."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method_, url, headers_, body_, post = self.api.param_serialize(
            method=method, resource_path=path, query_params=query or [], header_params=headers,
            body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method_, url, header_params=headers_, body=body_, post_params=post,
                                     _request_timeout=30)
        data = response.read()
        if response.status >= 400:
            try:
                message = json.loads(data).get("message", "")
            except (ValueError, AttributeError):
                message = data.decode(errors="replace")[:500]
            raise KubeError(method, path, response.status, message)
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str,
             labels: Mapping[str, str] | None = None, from_cache: bool = False) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace, optionally filtered by labels.

        ``from_cache``: the API server answers from its watch cache (possibly a moment old)
        instead of reading every object of the namespace from etcd and filtering them, which
        made each list cost O(objects in the namespace).
        """
        query = [("resourceVersion", "0")] if from_cache else []
        if labels:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items())))
        return self.request("GET", collection_path(api_version, kind, namespace), query=query).get("items", [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Deletes an object (background propagation: the garbage collector takes its children)."""
        try:
            self.request("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}",
                         body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status != 404:
                raise

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches the status subresource."""
        return self.request("PATCH", f"{collection_path(api_version, kind, namespace)}/{name}/status",
                            body={"status": dict(status)}, content_type="application/merge-patch+json")

    def apply(self, desired: Mapping[str, Any], observed: Mapping[str, Any] | None = None,
              *, looked_up: bool = False, update_if_created_meanwhile: bool = True) -> tuple[str, dict[str, Any]]:
        """Creates or updates ``desired``; returns ("created" | "updated" | "unchanged", object).

        Level-based and idempotent: an object equal to what was last applied, and whose
        fields still hold the desired values, is left alone. ``observed``: the object as read
        when ``desired`` was computed from it; the update then fails with HTTP 409 if it
        changed since (optimistic concurrency) instead of overwriting the change. ``looked_up``:
        ``observed`` is None because the object was not found (in a watch cache): no GET first.
        ``update_if_created_meanwhile``: a create that finds the object there updates it to ``desired``
        (else the HTTP 409 is raised: an object several owners share is recomputed from what is there).
        """
        desired = with_applied_hash(desired)
        meta = desired["metadata"]
        api_version, kind = desired["apiVersion"], desired["kind"]
        path = collection_path(api_version, kind, meta["namespace"])
        if observed is not None or looked_up:
            existing = dict(observed) if observed is not None else None
        else:
            existing = self.get(api_version, kind, meta["namespace"], meta["name"])
        query = [("fieldManager", self.field_manager)]
        if existing is None:
            try:
                return "created", self.request("POST", path, body=desired, query=query)
            except KubeError as exc:
                if exc.status != 409 or not update_if_created_meanwhile:
                    raise
                # Created meanwhile (another reconcile of the same owner): update it instead.
                existing = self.get(api_version, kind, meta["namespace"], meta["name"])
                if existing is None:
                    raise
        reason = update_reason(existing, desired)
        if reason is None:
            return "unchanged", existing
        merged = merge_for_update(existing, desired)
        log.info("updating %s %s/%s: %s differs", kind, meta["namespace"], meta["name"], reason)
        return "updated", self.request("PUT", f"{path}/{meta['name']}", body=merged, query=query)


def with_applied_hash(desired: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``desired`` annotated with the hash of its own content."""
    obj = copy.deepcopy(dict(desired))
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(ANNOTATION_APPLIED_HASH, None)
    # Write-once fields (a Secret's random key) are left out: they never trigger an update.
    hashed = {k: v for k, v in obj.items() if k not in WRITE_ONCE.get(obj["kind"], ())}
    annotations[ANNOTATION_APPLIED_HASH] = stable_hash(hashed, length=16)
    return obj


def first_difference(want: Any, have: Any, path: str = "") -> str | None:
    """The path of the first field of ``want`` that ``have`` lacks or holds differently."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return path or "."
        for key, value in want.items():
            if key not in have:
                return f"{path}.{key}"
            found = first_difference(value, have[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(want, list):
        if not isinstance(have, list) or len(want) != len(have):
            return path
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            found = first_difference(w, h, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if want == have else path


def update_reason(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> str | None:
    """Why ``existing`` must be updated to ``desired`` (the first differing field), or None."""
    skip = set(WRITE_ONCE.get(desired["kind"], ())) | {"metadata", "status"}
    for key, value in desired.items():
        if key not in skip:
            found = first_difference(value, existing.get(key), key)
            if found:
                return found
    meta, have = desired["metadata"], existing.get("metadata", {})
    for field in ("labels", "annotations", "ownerReferences"):
        empty: Any = [] if field == "ownerReferences" else {}
        found = first_difference(meta.get(field) or empty, have.get(field) or empty, f"metadata.{field}")
        if found:
            return found
    return None


def needs_update(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether ``existing`` lacks something ``desired`` sets, or was applied from another desire."""
    return update_reason(existing, desired) is not None


OPERATOR_LABELS_REMOVED_WHEN_ABSENT = (LABEL_ROLE,)


def merge_for_update(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The body of a PUT: desired content over the existing object's identity and metadata.

    Labels and annotations others added (controllers, kubectl) are kept; owner references
    and every top-level field the operator sets are replaced; write-once fields are kept.
    """
    merged = copy.deepcopy(dict(existing))
    keep = WRITE_ONCE.get(desired["kind"], ())
    for key, value in desired.items():
        if key in ("metadata", "status") or (key in keep and key in existing):
            continue
        merged[key] = copy.deepcopy(value)
    meta = merged.setdefault("metadata", {})
    for field in ("labels", "annotations"):
        meta[field] = {**(meta.get(field) or {}), **(desired["metadata"].get(field) or {})}
    wanted_labels = desired["metadata"].get("labels") or {}
    if wanted_labels.get(LABEL_MANAGED_BY) == MANAGED_BY:
        # Labels only the operator sets, which the desired object no longer carries (the role label of a
        # role's peer Service, which the router must not route by): removed, not kept.
        for key in OPERATOR_LABELS_REMOVED_WHEN_ABSENT:
            if key not in wanted_labels:
                meta["labels"].pop(key, None)
    if desired["metadata"].get("ownerReferences"):
        meta["ownerReferences"] = copy.deepcopy(desired["metadata"]["ownerReferences"])
    if desired["kind"] == "Service":
        keep_service_allocations(existing, merged)
    merged.pop("status", None)
    return merged


# Service fields the API server allocates and will not let an update clear.
SERVICE_ALLOCATED = ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy", "healthCheckNodePort")


def keep_service_allocations(existing: Mapping[str, Any], merged: dict[str, Any]) -> None:
    """Carries the allocated cluster IPs and node ports of ``existing`` into ``merged``."""
    have, spec = existing.get("spec") or {}, merged.setdefault("spec", {})
    for key in SERVICE_ALLOCATED:
        if key in have and key not in spec:
            spec[key] = copy.deepcopy(have[key])
    node_ports = {p.get("name"): p["nodePort"] for p in have.get("ports") or [] if p.get("nodePort")}
    for port in spec.get("ports") or []:
        if port.get("name") in node_ports and "nodePort" not in port:
            port["nodePort"] = node_ports[port["name"]]


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether ``obj`` lists an owner reference to ``owner_uid``."""
    return any(ref.get("uid") == owner_uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def controller_of(obj: Mapping[str, Any], kinds: Iterable[str]) -> dict[str, Any] | None:
    """The controlling owner reference of ``obj`` when its kind is one of ``kinds``."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") in set(kinds):
            return dict(ref)
    return None

