"""Pure builders of the shared KV store tier a ServingGroup asks for (``spec.kvStore``, docs/kv_tiers.md).

The store is a Mooncake Store master (`splitserve kv-store`: metadata only; the pool is the engines' own
segments) in a Deployment of one pod behind a Service, and the group's prefill and decode engines point
their ``--kv-store`` at that Service's DNS name (``SPLITSERVE_KV_STORE``, set on the ServingRoles).

- ``scope: group``: ``<group>-kv-store``, owned (controller) by the group like its other children; its pod
  carries the group's labels, so the group's engine NetworkPolicy admits only the group's pods to it.
- ``scope: namespace``: ``spec.kvStore.name`` (``splitserve-kv-store``), shared by every group that names it.
  Each such group is one of its owners (none is its controller): Kubernetes' garbage collector deletes it
  once the last of them is gone, and a group that stops using it takes only its own reference off. The
  first group to create it sets its settings (image, port, resources); the others join it as it is. Its
  pods and the engine pods using it carry ``splitserve.io/kv-store=<name>``: a NetworkPolicy of the same
  name admits only those to the master, and each group's engine policy admits them too (an engine reads
  pages from the segments of engines of other groups).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.operator.names import (
    DEFAULT_KV_STORE_PORT,
    GROUP_KIND,
    KV_STORE_ADMIN_PORT,
    KV_STORE_ROLE,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_KV_STORE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    kv_store_name,
)
from splitserve.operator.role_builders import common_labels, container_resources, selector_labels

Body = Mapping[str, Any]
DEFAULT_SEGMENT_MB = 512
# The kinds a KV store is made of, in the order they are applied (the policy before the pod it guards).
KV_STORE_KINDS = (("networking.k8s.io/v1", "NetworkPolicy"), ("v1", "Service"), ("apps/v1", "Deployment"))


def kv_store_spec(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """``spec.kvStore`` when enabled, else None."""
    kv = spec.get("kvStore") or {}
    return dict(kv) if kv.get("enabled") else None


def shared(kv: Mapping[str, Any]) -> bool:
    """Whether the store is the namespace's, shared by the groups naming it."""
    return kv.get("scope", "group") == "namespace"


def kv_store_port(kv: Mapping[str, Any]) -> int:
    return int(kv.get("port", DEFAULT_KV_STORE_PORT))


def kv_store_address(group_body: Body, port: int | None = None) -> str:
    """``<service>.<namespace>.svc:<port>``: the engines' ``--kv-store``. ``port``: the shared store's, as it
    exists (its creator's), instead of this group's spec."""
    meta, kv = group_body["metadata"], kv_store_spec(group_body["spec"]) or {}
    name = kv_store_name(meta["name"], kv)
    return f"{name}.{meta.get('namespace', 'default')}.svc:{port or kv_store_port(kv)}"


def engine_kv_store(group_body: Body, port: int | None = None) -> dict[str, Any] | None:
    """What a ServingRole's ``spec.kvStore`` says to its engines: the address, each engine's segment and, for
    a namespace store, its name (the pods' label); None without a store."""
    kv = kv_store_spec(group_body["spec"])
    if kv is None:
        return None
    wired: dict[str, Any] = {"address": kv_store_address(group_body, port),
                             "segmentMB": int(kv.get("segmentMB", DEFAULT_SEGMENT_MB))}
    if shared(kv):
        wired["name"] = kv_store_name(group_body["metadata"]["name"], kv)
    return wired


def kv_store_labels(group: str, kv: Mapping[str, Any]) -> dict[str, str]:
    """Labels of the store's objects and pod: the group's (group scope) or the store's own (namespace)."""
    if not shared(kv):
        return common_labels(group, KV_STORE_ROLE)
    name = kv_store_name(group, kv)
    return {LABEL_NAME: "splitserve", LABEL_INSTANCE: name, LABEL_COMPONENT: KV_STORE_ROLE,
            LABEL_MANAGED_BY: MANAGED_BY, LABEL_KV_STORE: name}


def kv_store_selector(group: str, kv: Mapping[str, Any]) -> dict[str, str]:
    """The (immutable) pod selector of the store's Deployment and Service."""
    if not shared(kv):
        return selector_labels(group, KV_STORE_ROLE)
    return {LABEL_KV_STORE: kv_store_name(group, kv), LABEL_COMPONENT: KV_STORE_ROLE}


def group_owner_reference(group_body: Body) -> dict[str, Any]:
    """A reference to the group as one owner among several (not the controller)."""
    meta = group_body["metadata"]
    return {"apiVersion": group_body.get("apiVersion", "splitserve.io/v1alpha1"), "kind": GROUP_KIND,
            "name": meta["name"], "uid": meta["uid"], "controller": False, "blockOwnerDeletion": False}


def owner_references(group_body: Body, existing: Body | None, keep: bool = True) -> list[dict[str, Any]]:
    """A shared object's owners: those it has, with this group added (``keep``) or taken off; by uid."""
    uid = group_body["metadata"]["uid"]
    refs = [dict(r) for r in (existing or {}).get("metadata", {}).get("ownerReferences") or [] if r.get("uid") != uid]
    if keep:
        refs.append(group_owner_reference(group_body))
    return sorted(refs, key=lambda r: r["uid"])


def build_kv_store_deployment(group_body: Body, default_image: str) -> dict[str, Any]:
    """One master pod (`splitserve kv-store`), replaced rather than rolled: two masters would split the store."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group, kv = meta["name"], kv_store_spec(spec) or {}
    port = kv_store_port(kv)
    labels = kv_store_labels(group, kv)
    container: dict[str, Any] = {
        "name": KV_STORE_ROLE,
        "image": kv.get("image") or spec.get("image") or default_image,
        "command": ["splitserve", "kv-store", "--host", "0.0.0.0", "--port", str(port),
                    "--admin-port", str(KV_STORE_ADMIN_PORT)],
        "ports": [{"name": "rpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "admin", "containerPort": KV_STORE_ADMIN_PORT, "protocol": "TCP"}],
        "resources": container_resources(kv.get("resources") or {}),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 20,
                          "failureThreshold": 3},
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    pod: dict[str, Any] = {"containers": [container], "automountServiceAccountToken": False,
                           "enableServiceLinks": False}
    if kv.get("nodeSelector"):
        pod["nodeSelector"] = dict(kv["nodeSelector"])
    if kv.get("tolerations"):
        pod["tolerations"] = copy.deepcopy(list(kv["tolerations"]))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": kv_store_name(group, kv), "namespace": meta.get("namespace", "default"),
                     "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": kv_store_selector(group, kv)},
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def build_kv_store_service(group_body: Body) -> dict[str, Any]:
    """The master's Service: the DNS name the engines' ``--kv-store`` names."""
    meta = group_body["metadata"]
    group, kv = meta["name"], kv_store_spec(group_body["spec"]) or {}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": kv_store_name(group, kv), "namespace": meta.get("namespace", "default"),
                     "labels": kv_store_labels(group, kv)},
        "spec": {
            "type": "ClusterIP",
            "selector": kv_store_selector(group, kv),
            "ports": [{"name": "rpc", "port": kv_store_port(kv), "targetPort": "rpc", "protocol": "TCP"},
                      {"name": "admin", "port": KV_STORE_ADMIN_PORT, "targetPort": "admin", "protocol": "TCP"}],
        },
    }


def build_kv_store_network_policy(group_body: Body) -> dict[str, Any]:
    """A namespace store's NetworkPolicy: its master admits only the engine pods labelled with its name."""
    meta = group_body["metadata"]
    group, kv = meta["name"], kv_store_spec(group_body["spec"]) or {}
    name = kv_store_name(group, kv)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": meta.get("namespace", "default"), "labels": kv_store_labels(group, kv)},
        "spec": {
            "podSelector": {"matchLabels": kv_store_selector(group, kv)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_KV_STORE: name}}}]}],
        },
    }


def build_kv_store(group_body: Body, default_image: str,
                   existing: Mapping[str, Body | None] | None = None) -> list[dict[str, Any]]:
    """The store's objects for a group with ``spec.kvStore.enabled`` (none without), in apply order.

    Group scope: a Service and a Deployment the group controls (its engine NetworkPolicy covers the pod).
    Namespace scope: those and a NetworkPolicy, each owned by every group using it; ``existing`` (kind ->
    the object as it is) keeps a shared object's content and other owners, adding this group's reference."""
    kv = kv_store_spec(group_body["spec"])
    if kv is None:
        return []
    objects = [build_kv_store_service(group_body), build_kv_store_deployment(group_body, default_image)]
    if not shared(kv):
        for obj in objects:
            kopf.adopt(obj, owner=dict(group_body))
        return objects
    objects.insert(0, build_kv_store_network_policy(group_body))
    for i, obj in enumerate(objects):
        current = (existing or {}).get(obj["kind"])
        if current is not None:  # its creator's settings stay: this group only joins its owners
            obj = objects[i] = {k: copy.deepcopy(v) for k, v in current.items() if k not in ("metadata", "status")}
            obj["metadata"] = {k: copy.deepcopy(v) for k, v in current["metadata"].items()
                               if k in ("name", "namespace", "labels")}
        obj["metadata"]["ownerReferences"] = owner_references(group_body, current)
    return objects


def shared_port(existing: Mapping[str, Body | None]) -> int | None:
    """The RPC port of a shared store's existing Service (its creator's), if it exists."""
    service = existing.get("Service")
    for port in ((service or {}).get("spec") or {}).get("ports") or []:
        if port.get("name") == "rpc":
            return int(port["port"])
    return None
