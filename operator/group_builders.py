"""Pure builders from a ServingGroup to its children.

A group owns one ServingRole per role in ``spec.roles`` (each becomes a StatefulSet and a
headless Service through ``role_builders``), the router Deployment and Service, a ConfigMap
with the peer-discovery information, a Secret with a random shared key, and two
NetworkPolicies: the engines admit only the group's own pods, the router its HTTP port.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.operator.names import (
    ANNOTATION_GROUP_REPLICAS,
    CONTROL_KEY,
    DEFAULT_HTTP_PORT,
    GROUP_API_VERSION,
    LABEL_GROUP,
    LABEL_KV_STORE,
    LABEL_ROLE,
    PEERS_FILE,
    PEERS_MOUNT,
    ROLE_KIND,
    ROLE_NAMES,
    ROUTER_ROLE,
    control_secret_name,
    engine_network_policy_name,
    kv_store_name,
    peers_configmap_name,
    role_object_name,
    router_name,
    router_network_policy_name,
)
from splitserve.operator.role_builders import common_labels, container_resources, env_var, selector_labels
from splitserve.operator.role_table import ROLE_TRAITS, bootstrap_port, mesh_port, traits

Body = Mapping[str, Any]
# Fields of spec.roles.<role> copied into the ServingRole's spec as they are.
# Fields of spec.speculative that name a role's own model (not copied into the roles' specs).
OWN_MODEL_FIELDS = {t.own_model for t in ROLE_TRAITS.values() if t.own_model}
ROLE_TEMPLATE_FIELDS = ("tensorParallelSize", "resources", "nodeSelector", "tolerations", "dtype",
                        "pageSize", "engineArgs", "env", "drainSeconds")


def group_roles(spec: Mapping[str, Any]) -> list[str]:
    """The roles a group has, in reconcile order."""
    roles = spec.get("roles") or {}
    return [role for role in ROLE_NAMES if roles.get(role) is not None]


def role_replicas(group_spec: Mapping[str, Any], role: str, existing_role: Body | None) -> int:
    """Replicas of a group's ServingRole.

    The group's value wins when the role is new or when the group's value changed since the
    group last pushed it; otherwise the role keeps what it has, so that ``kubectl scale`` or
    an autoscaler on the ServingRole is not undone on the next reconcile.
    """
    wanted = int(group_spec["roles"][role].get("replicas", 1))
    if existing_role is None:
        return wanted
    pushed = (existing_role.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_GROUP_REPLICAS)
    if pushed != str(wanted):
        return wanted
    return int(existing_role.get("spec", {}).get("replicas", wanted))


def build_serving_role(group_body: Body, role: str, revision: str, partition: int,
                       existing_role: Body | None, kv_store: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ServingRole for one role of a group; ``kv_store``: the engines' wiring to the group's KV store
    (``kv_store_builders.engine_kv_store``), for the roles that use one."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group = meta["name"]
    template = spec["roles"][role]
    own = traits(role).own_model
    own_model = (spec.get("speculative") or {}).get(own) if own else None
    role_spec: dict[str, Any] = {
        "group": group,
        "role": role,
        "replicas": role_replicas(spec, role, existing_role),
        "model": copy.deepcopy(dict(own_model or spec["model"])),
        "transfer": copy.deepcopy(dict(spec.get("transfer") or {})),
        "revision": revision,
        "updatePartition": int(partition),
        "peersConfigMap": peers_configmap_name(group),
        "controlSecret": control_secret_name(group),
    }
    for key in ROLE_TEMPLATE_FIELDS:
        if template.get(key) is not None:
            role_spec[key] = copy.deepcopy(template[key])
    image = template.get("image") or spec.get("image")
    if image:
        role_spec["image"] = image
    pull = template.get("imagePullPolicy") or spec.get("imagePullPolicy")
    if pull:
        role_spec["imagePullPolicy"] = pull
    if spec.get("speculative") is not None and traits(role).speculative:
        role_spec["speculative"] = {k: copy.deepcopy(v) for k, v in spec["speculative"].items()
                                    if k not in OWN_MODEL_FIELDS}
    if kv_store is not None and traits(role).kv_store:
        role_spec["kvStore"] = dict(kv_store)
    wanted = int(template.get("replicas", 1))
    obj = {
        "apiVersion": GROUP_API_VERSION,
        "kind": ROLE_KIND,
        "metadata": {
            "name": role_object_name(group, role),
            "namespace": meta.get("namespace", "default"),
            "labels": common_labels(group, role),
            "annotations": {ANNOTATION_GROUP_REPLICAS: str(wanted)},
        },
        "spec": role_spec,
    }
    kopf.adopt(obj, owner=dict(group_body))
    return obj


API_KEYS_MOUNT = "/etc/splitserve/api-keys"


def router_command(group: str, port: int) -> list[str]:
    """``splitserve router --kube-group G --host 0.0.0.0 --port P``.

    The router finds its prefill and decode pods itself, by watching the Endpoints of the
    group's role Services: scaling a role changes no field of its Deployment, so it never rolls.
    """
    # All interfaces: the router is reached through its Service, not from inside its own pod.
    return ["splitserve", "router", "--kube-group", group, "--host", "0.0.0.0", "--port", str(port)]


def router_port(spec: Mapping[str, Any]) -> int:
    """The router's container and Service port."""
    return int((spec.get("router") or {}).get("port", DEFAULT_HTTP_PORT))


def build_router_deployment(group_body: Body, default_image: str) -> dict[str, Any]:
    """The router Deployment, under the group's router ServiceAccount (it reads Endpoints)."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group, namespace = meta["name"], meta.get("namespace", "default")
    router = spec.get("router") or {}
    port = router_port(spec)
    labels = common_labels(group, ROUTER_ROLE)
    container: dict[str, Any] = {
        "name": "router",
        "image": router.get("image") or spec.get("image") or default_image,
        "command": router_command(group, port),
        "env": [
            {"name": env_var("ROUTER_KUBE_NAMESPACE"),
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": env_var("GROUP"), "value": group},
            {"name": env_var("ROLE"), "value": ROUTER_ROLE},
            {"name": env_var("SERVED_MODEL_NAME"), "value": str(spec["model"].get("name", ""))},
            {"name": env_var("PEERS_FILE"), "value": f"{PEERS_MOUNT}/{PEERS_FILE}"},
            # The router's --transfer-control-key: it signs each pair's bootstrap fields with it.
            {"name": env_var("ROUTER_TRANSFER_CONTROL_KEY"), "valueFrom": {"secretKeyRef": {
                "name": control_secret_name(group), "key": CONTROL_KEY}}},
        ],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": container_resources(router.get("resources") or {}),
        "volumeMounts": [{"name": "peers", "mountPath": PEERS_MOUNT, "readOnly": True}],
        # Ready while it has a healthy prefill and decode; alive whatever its backends do.
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 20},
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    volumes: list[dict[str, Any]] = [
        {"name": "peers", "configMap": {"name": peers_configmap_name(group), "optional": True}}]
    secret = router.get("apiKeySecret")
    if secret:
        # A mounted file, not an env var: the kubelet updates it when the Secret changes, and the router rereads it.
        key = secret.get("key", "api-keys")
        volumes.append({"name": "api-keys", "secret": {"secretName": secret["name"],
                                                      "items": [{"key": key, "path": "keys"}]}})
        container["volumeMounts"].append({"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True})
        container["env"].append({"name": env_var("ROUTER_API_KEY_FILE"), "value": f"{API_KEYS_MOUNT}/keys"})
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "serviceAccountName": router_name(group),
        "enableServiceLinks": False,
    }
    if router.get("nodeSelector"):
        pod["nodeSelector"] = dict(router["nodeSelector"])
    if router.get("tolerations"):
        pod["tolerations"] = copy.deepcopy(list(router["tolerations"]))
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_name(group), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": int(router.get("replicas", 1)),
            "selector": {"matchLabels": selector_labels(group, ROUTER_ROLE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    kopf.adopt(deployment, owner=dict(group_body))
    return deployment


def build_router_service_account(group_body: Body) -> dict[str, Any]:
    """The ServiceAccount the group's router runs as."""
    meta = group_body["metadata"]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": router_name(meta["name"]), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(meta["name"], ROUTER_ROLE)},
    }
    kopf.adopt(account, owner=dict(group_body))
    return account


def build_router_role_binding(group_body: Body, cluster_role: str) -> dict[str, Any]:
    """Grants the router's ServiceAccount the chart's router ClusterRole (read Endpoints) in its namespace."""
    meta = group_body["metadata"]
    name, namespace = router_name(meta["name"]), meta.get("namespace", "default")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace, "labels": common_labels(meta["name"], ROUTER_ROLE)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    kopf.adopt(binding, owner=dict(group_body))
    return binding


def build_router_service(group_body: Body) -> dict[str, Any]:
    """The router's Service: the group's OpenAI-compatible endpoint."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group = meta["name"]
    port = router_port(spec)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_name(group), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, ROUTER_ROLE)},
        "spec": {
            "type": (spec.get("router") or {}).get("serviceType", "ClusterIP"),
            "selector": selector_labels(group, ROUTER_ROLE),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    kopf.adopt(svc, owner=dict(group_body))
    return svc


def router_endpoint(group_body: Body) -> str:
    """URL of the router's Service inside the cluster."""
    meta = group_body["metadata"]
    return (f"http://{router_name(meta['name'])}.{meta.get('namespace', 'default')}.svc:"
            f"{router_port(group_body['spec'])}")


def peers_document(group_body: Body, replicas: Mapping[str, int]) -> dict[str, Any]:
    """What each pod needs to find its peers: per role, its Service and each pod's endpoints."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group, namespace = meta["name"], meta.get("namespace", "default")
    roles: dict[str, Any] = {}
    for role in group_roles(spec):
        name = role_object_name(group, role)
        endpoints = []
        for i in range(replicas.get(role, 0)):
            endpoint: dict[str, Any] = {"host": f"{name}-{i}.{name}.{namespace}.svc",
                                        "port": DEFAULT_HTTP_PORT, "index": i}
            endpoint.update({port.peers_key: port.number(spec) for port in traits(role).ports})
            endpoints.append(endpoint)
        roles[role] = {"service": f"{name}.{namespace}.svc", "replicas": replicas.get(role, 0),
                       "tensorParallelSize": int(spec["roles"][role].get("tensorParallelSize", 1)),
                       "endpoints": endpoints}
    document: dict[str, Any] = {
        "group": group,
        "namespace": namespace,
        "model": str(spec["model"].get("name", "")),
        "router": router_endpoint(group_body),
        "transfer": {"protocol": (spec.get("transfer") or {}).get("protocol", "tcp"),
                     "devices": list((spec.get("transfer") or {}).get("devices") or []),
                     "bootstrapPort": bootstrap_port(spec)},
        "roles": roles,
    }
    if spec.get("speculative") is not None:
        document["speculative"] = {"numDraftTokens": int(spec["speculative"].get("numDraftTokens", 4)),
                                   "meshPort": mesh_port(spec)}
    return document


def build_peers_configmap(group_body: Body, replicas: Mapping[str, int]) -> dict[str, Any]:
    """The ConfigMap holding :func:`peers_document`, mounted into every pod.

    It is a mounted file and not environment variables so that scaling one role updates the
    peers of the others in place instead of rolling their pods.
    """
    meta = group_body["metadata"]
    group = meta["name"]
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": peers_configmap_name(group), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, "peers")},
        "data": {PEERS_FILE: json.dumps(peers_document(group_body, replicas), indent=2, sort_keys=True)},
    }
    kopf.adopt(cm, owner=dict(group_body))
    return cm


def build_control_secret(group_body: Body, key: bytes) -> dict[str, Any]:
    """The Secret with the group's shared control-plane key.

    Mooncake's transfer ports listen on all interfaces without authentication; the control
    messages between the group's pods (bootstrap, draft mesh, router) carry this key.
    """
    meta = group_body["metadata"]
    group = meta["name"]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": control_secret_name(group), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, "control")},
        "data": {CONTROL_KEY: base64.b64encode(key).decode()},
    }
    kopf.adopt(secret, owner=dict(group_body))
    return secret


NETWORK_POLICY_COMPONENT = "network"


def group_pods_selector(group: str) -> dict[str, Any]:
    """Every pod of a group, engines and router: the pods the operator labels with the group."""
    return {"matchLabels": {LABEL_GROUP: group}}


def build_engine_network_policy(group_body: Body) -> dict[str, Any]:
    """The NetworkPolicy over a group's engine pods (every pod of the group but the router's):
    ingress only from the group's own pods (its engines and its router), on every port.

    Every port, not a list: besides the named ones (http, the prefill's bootstrap port, the
    embedding control port, the drafters' mesh gRPC port) the engines listen on ports they pick
    at run time (Mooncake's RPC handshake and TCP data ports, the transfer control socket, the
    draft mesh's data sockets). Nothing outside the group reaches an engine; egress is left open.
    The kubelet's probes still pass: CNI plugins admit a node's own traffic to its pods.
    Other policies add to this one (NetworkPolicies are a union), e.g. to let a Prometheus scrape
    the engines' /metrics.
    """
    meta = group_body["metadata"]
    group = meta["name"]
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": engine_network_policy_name(group), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, NETWORK_POLICY_COMPONENT)},
        "spec": {
            # NotIn rather than In the engine roles: a pod of the group without a role label, or of
            # a role added later, is closed too.
            "podSelector": {**group_pods_selector(group), "matchExpressions": [
                {"key": LABEL_ROLE, "operator": "NotIn", "values": [ROUTER_ROLE]}]},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": group_pods_selector(group)}]}],
        },
    }
    store = (group_body.get("spec") or {}).get("kvStore") or {}
    if store.get("enabled") and store.get("scope") == "namespace":
        # Engines of the other groups on the namespace's KV store read pages from these engines' segments.
        policy["spec"]["ingress"].append({"from": [{"podSelector": {"matchLabels": {
            LABEL_KV_STORE: kv_store_name(group, store)}}}]})
    if planner_enabled(group_body.get("spec") or {}):
        # The operator's planner reads the engines' /metrics (HTTP port only), from its own namespace.
        policy["spec"]["ingress"].append({
            "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}],
            "ports": [{"protocol": "TCP", "port": DEFAULT_HTTP_PORT}],
        })
    kopf.adopt(policy, owner=dict(group_body))
    return policy


# The operator pod's labels (the chart's selector labels, any release): what the planner scrapes from.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "splitserve-operator"}


def planner_enabled(spec: Mapping[str, Any]) -> bool:
    """Whether the group's ``spec.slo`` turns the SLO planner on."""
    return bool((spec.get("slo") or {}).get("enabled"))


def build_router_network_policy(group_body: Body) -> dict[str, Any]:
    """The NetworkPolicy over a group's router pods: their HTTP port (``spec.router.port``) from
    anywhere, the group's endpoint for its clients (through the router Service); nothing else."""
    meta, spec = group_body["metadata"], group_body["spec"]
    group = meta["name"]
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": router_network_policy_name(group), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, NETWORK_POLICY_COMPONENT)},
        "spec": {
            "podSelector": {"matchLabels": selector_labels(group, ROUTER_ROLE)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": router_port(spec)}]}],
        },
    }
    kopf.adopt(policy, owner=dict(group_body))
    return policy


def build_network_policies(group_body: Body) -> list[dict[str, Any]]:
    """A group's NetworkPolicies: its engines', then its router's."""
    return [build_engine_network_policy(group_body), build_router_network_policy(group_body)]
