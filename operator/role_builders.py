"""Pure builders from a ServingRole to its children: a StatefulSet and a headless Service.

Nothing here calls the API server; the handlers apply what these functions return.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.operator.names import (
    CONTROL_KEY,
    DEFAULT_HTTP_PORT,
    ENV_PREFIX,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_INSTANCE,
    LABEL_KV_STORE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REVISION,
    LABEL_ROLE,
    MANAGED_BY,
    PEERS_FILE,
    PEERS_MOUNT,
)
from splitserve.operator.role_table import ROLE_TRAITS, bootstrap_port, mesh_port, traits
from splitserve.operator.rollout import role_revision

Body = Mapping[str, Any]
MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
PEERS_VOLUME = "peers"
GPU_RESOURCE = "nvidia.com/gpu"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
# Engine settings the operator sets with spec.kvStore (as env vars); engineArgs and env may not set them then.
KV_STORE_ENGINE_FLAGS = ("--kv-store", "--kv-store-segment-mb")
# Engine flags the operator sets itself; engineArgs may not repeat them.
MANAGED_ENGINE_FLAGS = ("--role", "--model", "--host", "--port", "--tp-size", "--device", "--dtype", "--page-size",
                        *sorted({p.engine_flag for t in ROLE_TRAITS.values() for p in t.ports if p.engine_flag}))


def env_var(name: str) -> str:
    """The engine's environment variable for a name: SPLITSERVE_<NAME>."""
    return f"{ENV_PREFIX}_{name}"


# Environment variables the operator sets on every engine pod; spec.env may not repeat them.
MANAGED_ENV = tuple(env_var(n) for n in (
    "GROUP", "ROLE", "NAMESPACE", "POD_NAME", "POD_IP", "REPLICA_INDEX", "SERVICE", "REVISION",
    "SERVED_MODEL_NAME", "BOOTSTRAP_PORT", "TRANSFER_PROTOCOL", "TRANSFER_DEVICES", "TRANSFER_HOST", "PEERS_FILE",
    "TRANSFER_CONTROL_KEY", "NUM_DRAFT_TOKENS", "DRAFT_MESH_PORT",
))


def common_labels(group: str, component: str) -> dict[str, str]:
    """Labels every child of a group carries."""
    return {
        LABEL_NAME: "splitserve",
        LABEL_INSTANCE: group,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_GROUP: group,
        LABEL_ROLE: component,
    }


def selector_labels(group: str, role: str) -> dict[str, str]:
    """The (immutable) pod selector of a role's StatefulSet and Service."""
    return {LABEL_GROUP: group, LABEL_ROLE: role}


def selector_string(group: str, role: str) -> str:
    """The selector as a string, for the scale subresource's status.selector."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(group, role).items())


def model_path(model: Mapping[str, Any]) -> str:
    """Path of the checkpoint folder inside an engine pod (or the name of a built-in model)."""
    if model.get("builtin"):
        return str(model["builtin"])
    if model.get("imagePath"):
        return str(model["imagePath"])
    return str(model.get("mountPath") or "/models")


def model_volume(model: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod volume holding the weights, or None when they are in the image."""
    if model.get("pvc"):
        return {"name": MODEL_VOLUME, "persistentVolumeClaim": {
            "claimName": model["pvc"]["claimName"], "readOnly": True}}
    if model.get("hostPath"):
        return {"name": MODEL_VOLUME, "hostPath": {"path": model["hostPath"]["path"], "type": "Directory"}}
    return None


def model_mount(model: Mapping[str, Any]) -> dict[str, Any] | None:
    """The container's mount of :func:`model_volume`."""
    if model_volume(model) is None:
        return None
    mount = {"name": MODEL_VOLUME, "mountPath": model_path(model), "readOnly": True}
    if model.get("pvc", {}).get("subPath"):
        mount["subPath"] = model["pvc"]["subPath"]
    return mount


def engine_command(role: str, spec: Mapping[str, Any]) -> list[str]:
    """The engine container's command: ``splitserve serve --role <role> ...``."""
    tp = int(spec.get("tensorParallelSize", 1))
    gpus = int((spec.get("resources") or {}).get("gpus", 0))
    command = [
        "splitserve", "serve", "--role", role,
        "--model", model_path(spec["model"]),
        "--host", "0.0.0.0",
        "--port", str(DEFAULT_HTTP_PORT),
        "--tp-size", str(tp),
        "--device", "cuda" if gpus > 0 else "cpu",
    ]
    for port in traits(role).ports:
        if port.engine_flag:
            command += [port.engine_flag, str(port.number(spec))]
    if spec.get("dtype"):
        command += ["--dtype", str(spec["dtype"])]
    if spec.get("pageSize"):
        command += ["--page-size", str(spec["pageSize"])]
    return command + [str(arg) for arg in spec.get("engineArgs") or []]


def engine_env(name: str, spec: Mapping[str, Any], revision: str, namespace: str) -> list[dict[str, Any]]:
    """Environment of an engine container: who it is, where its peers and secrets are."""
    role, group = spec["role"], spec["group"]
    transfer = spec.get("transfer") or {}

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": env_var("GROUP"), "value": group},
        {"name": env_var("ROLE"), "value": role},
        {"name": env_var("NAMESPACE"), **field("metadata.namespace")},
        {"name": env_var("POD_NAME"), **field("metadata.name")},
        {"name": env_var("POD_IP"), **field("status.podIP")},
        # The StatefulSet ordinal is the replica's index in its role. Kubernetes >= 1.28 labels
        # the pod with it; on older servers this is empty and the "-<ordinal>" suffix of
        # SPLITSERVE_POD_NAME says the same.
        {"name": env_var("REPLICA_INDEX"), **field(f"metadata.labels['{POD_INDEX_LABEL}']")},
        {"name": env_var("SERVICE"), "value": f"{name}.{namespace}.svc"},
        {"name": env_var("REVISION"), "value": revision},
        {"name": env_var("SERVED_MODEL_NAME"), "value": str(spec["model"].get("name", ""))},
        {"name": env_var("BOOTSTRAP_PORT"), "value": str(bootstrap_port(spec))},
        {"name": env_var("TRANSFER_PROTOCOL"), "value": str(transfer.get("protocol", "tcp"))},
        {"name": env_var("TRANSFER_DEVICES"), "value": ",".join(transfer.get("devices") or [])},
        # Mooncake and the bootstrap server bind to and advertise this address: the pod's own.
        {"name": env_var("TRANSFER_HOST"), **field("status.podIP")},
    ]
    if spec.get("peersConfigMap"):
        env.append({"name": env_var("PEERS_FILE"), "value": f"{PEERS_MOUNT}/{PEERS_FILE}"})
    if spec.get("controlSecret"):
        # The engine's --transfer-control-key: HMAC on transfer control messages, bootstrap auth.
        env.append({"name": env_var("TRANSFER_CONTROL_KEY"), "valueFrom": {"secretKeyRef": {
            "name": spec["controlSecret"], "key": CONTROL_KEY}}})
    kv_store = spec.get("kvStore")
    if kv_store and traits(role).kv_store:
        # The engine's --kv-store and --kv-store-segment-mb: the group's KV store master, by its Service's name.
        env.append({"name": env_var("KV_STORE"), "value": str(kv_store["address"])})
        env.append({"name": env_var("KV_STORE_SEGMENT_MB"), "value": str(kv_store.get("segmentMB", 512))})
    if spec.get("speculative") and traits(role).speculative:
        env.append({"name": env_var("NUM_DRAFT_TOKENS"),
                    "value": str(spec["speculative"].get("numDraftTokens", 4))})
        env.append({"name": env_var("DRAFT_MESH_PORT"), "value": str(mesh_port(spec))})
    env += [{"name": e["name"], "value": str(e.get("value", ""))} for e in spec.get("env") or []]
    # The API server stores an empty value as no value; write it the same way so that the
    # object read back equals the object built.
    return [{k: v for k, v in e.items() if not (k == "value" and v == "")} for e in env]


def container_ports(role: str, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Named ports of an engine container."""
    ports = [{"name": "http", "containerPort": DEFAULT_HTTP_PORT, "protocol": "TCP"}]
    ports += [{"name": p.name, "containerPort": p.number(spec), "protocol": "TCP"} for p in traits(role).ports]
    return ports


def container_resources(resources: Mapping[str, Any]) -> dict[str, Any]:
    """A container's ResourceRequirements: requests, limits, and the GPUs as nvidia.com/gpu."""
    out: dict[str, Any] = {}
    for kind in ("requests", "limits"):
        if resources.get(kind):
            out[kind] = {k: str(v) for k, v in resources[kind].items()}
    gpus = int(resources.get("gpus", 0) or 0)
    if gpus:
        out.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        out.setdefault("requests", {})[GPU_RESOURCE] = str(gpus)
    return out


def engine_pod_spec(name: str, spec: Mapping[str, Any], revision: str, namespace: str,
                    default_image: str) -> dict[str, Any]:
    """The PodSpec of one engine replica."""
    role = spec["role"]
    model = spec["model"]
    mounts = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
    if model_volume(model) is not None:
        volumes.append(model_volume(model))
        mounts.append(model_mount(model))
    if spec.get("peersConfigMap"):
        volumes.append({"name": PEERS_VOLUME, "configMap": {"name": spec["peersConfigMap"], "optional": True}})
        mounts.append({"name": PEERS_VOLUME, "mountPath": PEERS_MOUNT, "readOnly": True})
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.get("image") or default_image,
        "command": engine_command(role, spec),
        "env": engine_env(name, spec, revision, namespace),
        "ports": container_ports(role, spec),
        "resources": container_resources(spec.get("resources") or {}),
        "volumeMounts": mounts,
        # Loading a large checkpoint takes minutes: the startup probe allows an hour.
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 360},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 20, "failureThreshold": 3},
    }
    drain = drain_seconds(spec)
    # Scale-down loses no request: the pod leaves its serving Service's Endpoints (the router stops sending it
    # new requests) and this hook holds the SIGTERM back until the engine is idle (operator/prestop.py).
    container["lifecycle"] = {"preStop": {"exec": {"command": [
        "python3", "-m", "splitserve.operator.prestop", "--port", str(DEFAULT_HTTP_PORT),
        "--settle", str(PRESTOP_SETTLE_S), "--timeout", str(drain)]}}}
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    if (spec.get("transfer") or {}).get("protocol") == "rdma":
        # RDMA memory registration pins pages.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # Engines never talk to the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The preStop hook's wait, then the engine's own graceful shutdown.
        "terminationGracePeriodSeconds": drain + SHUTDOWN_GRACE_S,
    }
    if spec.get("nodeSelector"):
        pod["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("tolerations"):
        pod["tolerations"] = copy.deepcopy(list(spec["tolerations"]))
    return pod


DEFAULT_DRAIN_S = 120
PRESTOP_SETTLE_S = 5
SHUTDOWN_GRACE_S = 10


def drain_seconds(spec: Mapping[str, Any]) -> int:
    """Seconds a terminating engine pod may finish its requests (``drainSeconds``, default 120)."""
    value = spec.get("drainSeconds")
    return DEFAULT_DRAIN_S if value is None else int(value)


def serving_service_name(role_name: str) -> str:
    """The Service whose Endpoints the router routes to: ``<group>-<role>-serving``."""
    return f"{role_name}-serving"


def build_statefulset(role_body: Body, default_image: str) -> dict[str, Any]:
    """The StatefulSet of a ServingRole: stable names and ordinals for the engine pods."""
    meta, spec = role_body["metadata"], role_body["spec"]
    name, namespace = meta["name"], meta.get("namespace", "default")
    group, role = spec["group"], spec["role"]
    revision = role_revision(spec)
    labels = common_labels(group, role)
    pod_labels = {**labels, LABEL_REVISION: revision}
    shared_store = (spec.get("kvStore") or {}).get("name")
    if shared_store and traits(role).kv_store:
        pod_labels[LABEL_KV_STORE] = shared_store  # a namespace KV store's NetworkPolicies admit its engines
    replicas = int(spec.get("replicas", 1))
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(group, role)},
            # Pods start together; ranks come from the stable ordinals, not start order.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate",
                               "rollingUpdate": {"partition": int(spec.get("updatePartition", 0))}},
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": engine_pod_spec(name, spec, revision, namespace, default_image),
            },
        },
    }
    kopf.adopt(sts, owner=dict(role_body))
    return sts


def build_headless_service(role_body: Body) -> dict[str, Any]:
    """The headless Service giving each engine pod a stable DNS name (<pod>.<role>.<ns>.svc)."""
    meta, spec = role_body["metadata"], role_body["spec"]
    group, role = spec["group"], spec["role"]
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in container_ports(role, spec)]
    # No role label: the router routes by the role label of Endpoints, and these Endpoints keep terminating
    # pods (publishNotReadyAddresses); the serving Service's do not.
    labels = {k: v for k, v in common_labels(group, role).items() if k != LABEL_ROLE}
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace", "default"), "labels": labels},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(group, role),
            "ports": ports,
            # Peers must find each other (bootstrap, draft mesh) before they report ready.
            "publishNotReadyAddresses": True,
        },
    }
    kopf.adopt(svc, owner=dict(role_body))
    svc["metadata"]["labels"].pop(LABEL_ROLE, None)  # adopt copies the ServingRole's labels, its role's too
    return svc


def build_serving_service(role_body: Body) -> dict[str, Any]:
    """The headless Service the router watches (by its group and role labels): only ready pods, and a pod leaves
    its Endpoints as soon as it is terminating, so a scaled-down pod gets no new request while it drains."""
    meta, spec = role_body["metadata"], role_body["spec"]
    group, role = spec["group"], spec["role"]
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": serving_service_name(meta["name"]), "namespace": meta.get("namespace", "default"),
                     "labels": common_labels(group, role)},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(group, role),
            "ports": [{"name": "http", "port": DEFAULT_HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    kopf.adopt(svc, owner=dict(role_body))
    return svc


def build_role_children(role_body: Body, default_image: str) -> list[dict[str, Any]]:
    """Every child of a ServingRole, in the order to apply them."""
    return [build_headless_service(role_body), build_serving_service(role_body),
            build_statefulset(role_body, default_image)]
