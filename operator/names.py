"""Names shared by the CRDs, the builders and the handlers: API group, labels, ports."""

from __future__ import annotations

API_GROUP = "splitserve.io"
API_VERSION = "v1alpha1"
GROUP_API_VERSION = f"{API_GROUP}/{API_VERSION}"
GROUP_PLURAL = "servinggroups"
ROLE_PLURAL = "servingroles"
GROUP_KIND = "ServingGroup"
ROLE_KIND = "ServingRole"

# Every role a group may have, in the order they are listed and reconciled.
ROLE_NAMES = ("prefill", "decode", "encode", "drafter")
# The roles whose rolling updates are kept within spec.rollout.maxSkewPercent of each other:
# a prefill and a decode pod exchange KV pages, so their revisions must stay close.
SKEW_BOUND_ROLES = ("prefill", "decode")

LABEL_GROUP = f"{API_GROUP}/group"
LABEL_ROLE = f"{API_GROUP}/role"
LABEL_REVISION = f"{API_GROUP}/revision"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "splitserve-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
# On a namespace-scope KV store's pods and on the engine pods using it: who may reach whom.
LABEL_KV_STORE = f"{API_GROUP}/kv-store"
# Annotation on a child holding the hash of what the operator last wrote: a change of the
# desired object (including a removed key) is seen even where the server adds defaults.
ANNOTATION_APPLIED_HASH = f"{API_GROUP}/applied-hash"
# Annotation on a ServingRole: the replicas the group last pushed, so that a later
# `kubectl scale sr/...` is not undone unless the group's own value changes.
ANNOTATION_GROUP_REPLICAS = f"{API_GROUP}/group-replicas"

# Models `splitserve serve --model NAME` builds itself (spec.model.builtin).
BUILTIN_MODELS = ("tiny",)

ROUTER_ROLE = "router"
DEFAULT_HTTP_PORT = 8000
DEFAULT_BOOTSTRAP_PORT = 8998
# The embedding transfer's ZeroMQ control port on encode and prefill pods (spec.transfer.embeddingPort).
DEFAULT_EMBEDDING_PORT = 8999
DEFAULT_DRAFT_MESH_PORT = 50061
# The Mooncake Store master of spec.kvStore: its RPC port (Mooncake's default) and its admin port (/health, /metrics).
KV_STORE_ROLE = "kv-store"
DEFAULT_KV_STORE_PORT = 50051
KV_STORE_ADMIN_PORT = 9003
DEFAULT_NAMESPACE_KV_STORE = "splitserve-kv-store"
PEERS_FILE = "peers.json"
PEERS_MOUNT = "/etc/splitserve/peers"
CONTROL_KEY = "key"
ENV_PREFIX = "SPLITSERVE"
# Longest group name: "<group>-<role>" names a StatefulSet, whose pods' hostnames
# ("<sts>-<ordinal>") and controller-revision-hash label must stay within 63 characters.
MAX_GROUP_NAME = 40


def role_object_name(group: str, role: str) -> str:
    """Name of a group's ServingRole, and of that role's StatefulSet and headless Service."""
    return f"{group}-{role}"


def router_name(group: str) -> str:
    """Name of a group's router Deployment and Service."""
    return f"{group}-router"


def peers_configmap_name(group: str) -> str:
    """Name of a group's peer-discovery ConfigMap."""
    return f"{group}-peers"


def engine_network_policy_name(group: str) -> str:
    """Name of the NetworkPolicy over a group's engine pods (every role but the router)."""
    return f"{group}-engines"


def router_network_policy_name(group: str) -> str:
    """Name of the NetworkPolicy over a group's router pods (the router Deployment's name)."""
    return router_name(group)


def control_secret_name(group: str) -> str:
    """Name of a group's Secret with the shared control-plane key."""
    return f"{group}-control"


def kv_store_name(group: str, kv_store: dict | None) -> str:
    """Name of the KV store master's Deployment and Service a group uses: its own (``<group>-kv-store``) or the
    namespace's (``spec.kvStore.name``, shared by every group that names it)."""
    kv_store = kv_store or {}
    if kv_store.get("scope", "group") == "namespace":
        return str(kv_store.get("name") or DEFAULT_NAMESPACE_KV_STORE)
    return f"{group}-{KV_STORE_ROLE}"
