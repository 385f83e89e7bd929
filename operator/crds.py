"""The custom resource definitions: the one source of truth for their OpenAPI v3 schemas.

``manifests/crds/*.yaml`` and ``charts/splitserve/crds/*.yaml`` are generated from this
module (``python -P -m splitserve.operator.crds --write``); a test fails when they drift.

The schemas are structural and strict enough that ``kubectl apply`` of a bad spec is refused
by the API server with a message naming the field. Checks that span several fields and
that OpenAPI v3 cannot express on every supported Kubernetes version live in
``splitserve.operator.validation`` and surface as the ``Degraded`` condition.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from typing import Any

import yaml

from splitserve.operator.names import (
    API_GROUP,
    API_VERSION,
    BUILTIN_MODELS,
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_DRAFT_MESH_PORT,
    DEFAULT_EMBEDDING_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_KV_STORE_PORT,
    ROLE_NAMES,
)

log = logging.getLogger(__name__)

Schema = dict[str, Any]

# Kubernetes' own quantity syntax (resource.Quantity), as controller-gen writes it.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SERVICE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # RFC 1035 labels
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ABSOLUTE_PATH_PATTERN = r"^/.*$"
ENGINE_ARG_PATTERN = r"^--[a-z0-9][a-z0-9-]*(=.*)?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
DEVICE_PATTERN = r"^[A-Za-z0-9_.:-]+$"
SERVED_MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"
TENSOR_PARALLEL_SIZES = [1, 2, 4, 8, 16]


def _obj(properties: dict[str, Schema], description: str, required: list[str] | None = None,
         **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = required
    schema.update(extra)
    return schema


def _int(description: str, minimum: int | None = None, maximum: int | None = None,
         **extra: Any) -> Schema:
    schema: Schema = {"type": "integer", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    schema.update(extra)
    return schema


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _port(description: str, default: int | None = None, minimum: int = 1) -> Schema:
    extra = {} if default is None else {"default": default}
    return _int(description, minimum, 65535, **extra)


def _quantity_map(description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "additionalProperties": {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        },
    }


def _string_map(description: str) -> Schema:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def _tolerations() -> Schema:
    return {
        "type": "array",
        "description": "Pod tolerations, as in a PodSpec.",
        "maxItems": 32,
        "items": _obj(
            {
                "key": _str("Taint key; empty with operator Exists matches every taint.", maxLength=316),
                "operator": _str("Exists or Equal (the default).", enum=["Exists", "Equal"]),
                "value": _str("Taint value, for operator Equal.", maxLength=63),
                "effect": _str("Taint effect to match; empty matches all.",
                               enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
                "tolerationSeconds": _int("For NoExecute: how long the pod stays bound.", 0),
            },
            "One toleration.",
        ),
    }


def _resources(with_gpus: bool) -> Schema:
    properties: dict[str, Schema] = {
        "requests": _quantity_map("Minimum compute resources (cpu, memory, ...) per pod."),
        "limits": _quantity_map("Maximum compute resources per pod; extended resources go here too."),
    }
    if with_gpus:
        properties["gpus"] = _int(
            "NVIDIA GPUs per pod (nvidia.com/gpu). 0 runs the engine on CPU; otherwise it must "
            "equal tensorParallelSize (one GPU per tensor-parallel rank).", 0, 64, default=0)
    return _obj(properties, "Compute resources of each pod.")


def _image_pull_policy() -> Schema:
    return _str("Image pull policy of the containers.", enum=["Always", "IfNotPresent", "Never"])


def role_template_properties() -> dict[str, Schema]:
    """The per-role fields shared by ``ServingGroup.spec.roles.<role>`` and ``ServingRole.spec``."""
    return {
        "replicas": _int("Pods of this role. A ServingRole may be scaled on its own afterwards "
                         "(kubectl scale, an autoscaler); the group only pushes a value it changed.",
                         0, 1000, default=1),
        "tensorParallelSize": _int("Tensor-parallel ranks per pod.", default=1,
                                   enum=TENSOR_PARALLEL_SIZES),
        "image": _str("Engine image for this role (default: the group's, then the operator's).",
                      minLength=1, maxLength=512),
        "imagePullPolicy": _image_pull_policy(),
        "resources": _resources(with_gpus=True),
        "nodeSelector": _string_map("Node labels the pods must match."),
        "tolerations": _tolerations(),
        "dtype": _str("Weights and activations dtype (engine --dtype).",
                      enum=["auto", "float32", "float16", "bfloat16"]),
        "pageSize": _int("KV cache page size in tokens (engine --page-size).", 1, 1024),
        "drainSeconds": _int("On scale-down or deletion, how long a pod may finish its requests in flight "
                             "(its preStop hook waits until the engine is idle; the grace period is this + 10). "
                             "Default 120.", 0, 3600),
        "engineArgs": {
            "type": "array",
            "description": "Extra engine flags, each written --flag or --flag=value.",
            "maxItems": 64,
            "items": _str("One engine flag.", pattern=ENGINE_ARG_PATTERN, maxLength=1024),
        },
        "env": {
            "type": "array",
            "description": "Extra environment variables of the engine container.",
            "maxItems": 64,
            "items": _obj(
                {"name": _str("Variable name.", pattern=ENV_NAME_PATTERN, maxLength=256),
                 "value": _str("Variable value.", maxLength=32768)},
                "One variable.", required=["name"]),
        },
    }


def model_schema() -> Schema:
    """``spec.model``: the served name and exactly one place the weights come from."""
    return _obj(
        {
            "name": _str("Model name served by the OpenAI-compatible API.",
                         pattern=SERVED_MODEL_NAME_PATTERN, maxLength=128),
            "pvc": _obj(
                {"claimName": _str("PersistentVolumeClaim holding the checkpoint.",
                                   pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
                 "subPath": _str("Folder inside the claim.", maxLength=1024)},
                "Weights on a PersistentVolumeClaim, mounted read-only.", required=["claimName"]),
            "hostPath": _obj(
                {"path": _str("Folder on every node.", pattern=ABSOLUTE_PATH_PATTERN, maxLength=1024)},
                "Weights in a folder of the node.", required=["path"]),
            "imagePath": _str("Weights baked into the engine image, at this absolute path.",
                              pattern=ABSOLUTE_PATH_PATTERN, maxLength=1024),
            "builtin": _str("A model built into splitserve: 'tiny' (random weights, a byte-level "
                            "tokenizer; for trying a deployment out on CPUs).", enum=list(BUILTIN_MODELS)),
            "mountPath": _str("Where pvc or hostPath weights are mounted in the pod.",
                              pattern=ABSOLUTE_PATH_PATTERN, maxLength=1024, default="/models"),
        },
        "Where the weights are: exactly one of pvc, hostPath, imagePath, builtin.",
        required=["name"],
        oneOf=[{"required": ["pvc"]}, {"required": ["hostPath"]}, {"required": ["imagePath"]},
               {"required": ["builtin"]}],
    )


def transfer_schema() -> Schema:
    """``spec.transfer``: how KV pages and embeddings move between pods (Mooncake)."""
    return _obj(
        {
            "protocol": _str("Mooncake transport: rdma in production, tcp without RDMA NICs.",
                             enum=["rdma", "tcp"], default="tcp"),
            "devices": {
                "type": "array",
                "description": "RDMA devices to use (e.g. mlx5_0); empty lets Mooncake pick.",
                "maxItems": 16,
                "items": _str("One device name.", pattern=DEVICE_PATTERN, maxLength=64),
            },
            "bootstrapPort": _port("Port of each prefill pod's bootstrap server.",
                                   DEFAULT_BOOTSTRAP_PORT, minimum=1024),
            "embeddingPort": _port("Control port of the image embedding transfer on each encode and prefill "
                                   "pod.", DEFAULT_EMBEDDING_PORT, minimum=1024),
        },
        "KV and embedding transfer between pods.",
        default={},
    )


def speculative_schema() -> Schema:
    """``spec.speculative``: decoupled speculative decoding with the drafter role."""
    return _obj(
        {
            "numDraftTokens": _int("Draft tokens the verifier asks for per step.", 1, 16, default=4),
            "meshPort": _port("gRPC DraftMesh port of each drafter pod.", DEFAULT_DRAFT_MESH_PORT,
                              minimum=1024),
            "draftModel": {**model_schema(), "description": (
                "The drafters' (small) model, same fields as spec.model; default: spec.model.")},
        },
        "Decoupled speculative decoding; needs the drafter role.",
    )


def router_schema() -> Schema:
    """``spec.router``: the OpenAI-compatible router Deployment and its Service."""
    return _obj(
        {
            "replicas": _int("Router pods.", 0, 100, default=1),
            "port": _port("Router Service and container port.", DEFAULT_HTTP_PORT),
            "serviceType": _str("Type of the router's Service.",
                                enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"),
            "image": _str("Router image (default: the group's).", minLength=1, maxLength=512),
            "resources": _resources(with_gpus=False),
            "nodeSelector": _string_map("Node labels the router pods must match."),
            "tolerations": _tolerations(),
            "apiKeySecret": _obj(
                {"name": _str("The Secret's name.", minLength=1, maxLength=253),
                 "key": _str("The Secret's key holding the keys, one per line.", minLength=1, maxLength=253,
                             default="api-keys")},
                "A Secret of client API keys: clients must send one as 'Authorization: Bearer KEY'. Mounted as a "
                "file the router reads again when it changes, so a rotated Secret needs no restart.",
                required=["name"]),
        },
        "The router in front of prefill and decode.",
        default={},
    )


def kv_store_schema() -> Schema:
    """``spec.kvStore``: the shared KV store tier, a Mooncake Store master the operator runs."""
    return _obj(
        {
            "enabled": {"type": "boolean", "description": "Run a KV store master and wire the prefill and decode "
                        "engines to it (their --kv-store).", "default": False},
            "scope": _str("group: a master of the group's own (<group>-kv-store); namespace: one shared by every "
                          "group of the namespace that names it, deleted with the last of them.",
                          enum=["group", "namespace"], default="group"),
            "name": _str("The namespace store's name (scope namespace; default splitserve-kv-store): a Service "
                         "name, so it starts with a letter.", pattern=SERVICE_NAME_PATTERN, maxLength=63),
            "port": _port("The master's RPC port (a namespace store keeps its creator's).", DEFAULT_KV_STORE_PORT,
                          minimum=1024),
            "segmentMB": _int("Host memory each engine gives the store's pool, MiB (--kv-store-segment-mb).", 0,
                              1 << 20, default=512),
            "image": _str("The master's image (default: the group's).", minLength=1, maxLength=512),
            "resources": _resources(with_gpus=False),
            "nodeSelector": _string_map("Node labels the master pod must match."),
            "tolerations": _tolerations(),
        },
        "A KV store tier shared by the engines (docs/kv_tiers.md): pages evicted from one engine's device are "
        "read by the others.",
    )


def engine_kv_store_schema() -> Schema:
    """A ServingRole's ``spec.kvStore``: where its engines find the store (set by the group)."""
    return _obj(
        {
            "address": _str("The master's HOST:PORT.", minLength=3, maxLength=300),
            "segmentMB": _int("Host memory each engine gives the store's pool, MiB.", 0, 1 << 20, default=512),
            "name": _str("A namespace store's name: the engine pods' splitserve.io/kv-store label.",
                         pattern=DNS_LABEL_PATTERN, maxLength=63),
        },
        "The engines' KV store (--kv-store).",
        required=["address"],
    )


def rollout_schema() -> Schema:
    """``spec.rollout``: how a new revision rolls through the roles."""
    return _obj(
        {
            "maxSkewPercent": _int(
                "During a rolling update, how far (percent of pods on the new revision) prefill "
                "and decode may get ahead of each other.", 0, 100, default=25),
        },
        "Rolling update policy.",
        default={},
    )


def _number(description: str, minimum: float | None = None, maximum: float | None = None,
            exclusive_minimum: bool = False, **extra: Any) -> Schema:
    schema: Schema = {"type": "number", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
        if exclusive_minimum:
            schema["exclusiveMinimum"] = True
    if maximum is not None:
        schema["maximum"] = maximum
    schema.update(extra)
    return schema


PLANNED_ROLES = ("prefill", "decode")


def slo_schema() -> Schema:
    """``spec.slo``: latency targets the operator's planner sizes prefill and decode to."""
    limits = {
        role: _obj(
            {"minReplicas": _int(f"Fewest {role} replicas the planner may set.", 1, 1000, default=1),
             "maxReplicas": _int(f"Most {role} replicas the planner may set (at least minReplicas).",
                                 1, 1000, default=8)},
            f"Bounds on the planner's {role} replicas.", default={})
        for role in PLANNED_ROLES
    }
    return _obj(
        {
            "enabled": {"type": "boolean", "default": False, "description": (
                "Run the planner: every intervalSeconds it reads the group's metrics and sets the prefill "
                "and decode ServingRoles' replicas (their scale subresource) to meet the targets. Off: "
                "replicas stay where spec.roles, kubectl scale or an autoscaler put them.")},
            "ttftSeconds": _number("Time-to-first-token target, seconds, at the percentile.", 0, 600,
                                   exclusive_minimum=True),
            "itlSeconds": _number("Inter-token latency target, seconds, at the percentile.", 0, 10,
                                  exclusive_minimum=True),
            "percentile": _number("Percentile of requests the targets hold for (e.g. 90 or 99).", 50, 99.9,
                                  default=90),
            "intervalSeconds": _int("Seconds between two planner decisions (and the metrics window).",
                                    5, 3600, default=15),
            "startupSeconds": _int("Seconds a new engine pod takes to serve: the planner sizes for the load "
                                   "this far ahead.", 0, 7200, default=120),
            "scaleDownIntervals": _int("Consecutive intervals a role must be oversized before it is "
                                       "scaled down.", 1, 100, default=4),
            "roles": _obj(limits, "Per-role replica bounds.", default={}),
            "roleSwitch": {"type": "boolean", "default": True, "description": (
                "When one of prefill and decode needs replicas while the other has idle ones, switch idle "
                "engines across at run time (seconds: they drain, swap roles and keep their weights; a switched "
                "pod stays in its StatefulSet, annotated splitserve.io/serving-role) before starting pods "
                "(minutes). A switch an engine refuses (tensor parallel, an engine core in its own process) is "
                "made up for by scaling in the same interval.")},
        },
        "Service-level objectives and the planner that sizes prefill and decode to them.",
        required=["ttftSeconds", "itlSeconds"],
    )


def planner_status_schema() -> Schema:
    """``status.planner``: what the planner saw and decided last."""
    per_role_int = _obj({role: _int(f"The {role} role.", 0) for role in PLANNED_ROLES}, "Per role.")
    return _obj(
        {
            "lastRunTime": _str("When the planner last ran.", format="date-time"),
            "lastDecisionTime": _str("When the planner last changed replicas.", format="date-time"),
            "observed": _obj(
                {
                    "ttftSeconds": _number("TTFT at the SLO percentile over the last interval."),
                    "itlSeconds": _number("Inter-token latency at the SLO percentile over the last interval."),
                    "arrivalRate": _number("Requests per second arriving at the router."),
                    "promptTokens": _number("Mean prompt tokens per request."),
                    "outputTokens": _number("Mean output tokens per request."),
                    "prefillQueueTokens": _int("Prompt tokens queued at prefill (estimated).", 0),
                    "waiting": {**per_role_int, "description": "Requests waiting, summed over each role's pods."},
                    "running": {**per_role_int, "description": "Requests running, summed over each role's pods."},
                    "kvUsage": _number("Mean fraction of decode KV pages in use.", 0, 1),
                    "scraped": _str("Pods scraped / pods found, per role."),
                },
                "The last interval as the metrics showed it."),
            "current": _str("prefill:decode replicas serving when the planner last ran."),
            "desired": _str("prefill:decode replicas the planner wants."),
            "serving": _str("prefill:decode replicas serving after its decision (switched pods under the role "
                            "they serve)."),
            "switched": _str("Pods serving the other role than their StatefulSet's."),
            "replicas": _obj(
                {role: _obj({"current": _int("Replicas before the decision.", 0),
                             "desired": _int("Replicas the planner set.", 0)}, f"The {role} role.")
                 for role in PLANNED_ROLES}, "Replicas per role."),
            "lastDecision": _str("The last change of replicas and why."),
            "message": _str("The last run in words: why nothing changed, or what failed."),
        },
        "The SLO planner's view (only with spec.slo.enabled).",
    )


def _conditions() -> Schema:
    return {
        "type": "array",
        "description": "Ready, Progressing and Degraded.",
        "items": _obj(
            {
                "type": _str("Condition type."),
                "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
                "reason": _str("One CamelCase word."),
                "message": _str("Human-readable details."),
                "lastTransitionTime": _str("When status last changed.", format="date-time"),
                "observedGeneration": _int("Generation the condition was computed from.", 0),
            },
            "One condition.",
            required=["type", "status"],
        ),
    }


def _replica_counts(description: str) -> Schema:
    return _obj(
        {"desired": _int("Pods wanted.", 0), "ready": _int("Pods ready.", 0),
         "updated": _int("Pods on the current revision and ready.", 0)},
        description,
    )


def serving_group_schema() -> Schema:
    """OpenAPI v3 schema of the ServingGroup resource."""
    roles = _obj(
        {role: _obj(role_template_properties(), f"The {role} role.") for role in ROLE_NAMES},
        "The roles: prefill and decode always, encode and drafter optionally.",
        required=["prefill", "decode"],
    )
    spec = _obj(
        {
            "model": model_schema(),
            "image": _str("Default engine and router image (default: the operator's).",
                          minLength=1, maxLength=512),
            "imagePullPolicy": _image_pull_policy(),
            "roles": roles,
            "router": router_schema(),
            "transfer": transfer_schema(),
            "speculative": speculative_schema(),
            "rollout": rollout_schema(),
            "slo": slo_schema(),
            "kvStore": kv_store_schema(),
        },
        "One model served by disaggregated roles.",
        required=["model", "roles"],
    )
    status = _obj(
        {
            "observedGeneration": _int("metadata.generation last reconciled.", 0),
            "revision": _str("Revision of the pod-affecting spec; pods carry it as a label."),
            "rolesReady": _str("Ready/desired pods per role, for kubectl get."),
            "pd": _str("Ready prefill:decode pods."),
            "desiredPD": _str("Desired prefill:decode pods (the roles' replicas: what the planner or a scale set)."),
            "routerEndpoint": _str("URL of the router's Service inside the cluster."),
            "roles": _obj({role: _replica_counts(f"The {role} role.") for role in ROLE_NAMES},
                          "Pod counts per role."),
            "router": _replica_counts("Router pods."),
            "conditions": _conditions(),
            "planner": planner_status_schema(),
            "kvStore": _obj({"name": _str("The master's Deployment and Service."),
                             "address": _str("The engines' --kv-store.")},
                            "The KV store the engines use (spec.kvStore)."),
        },
        "Observed state.",
    )
    return _obj({"spec": spec, "status": status}, "A model served by disaggregated roles.",
                required=["spec"])


def serving_role_schema() -> Schema:
    """OpenAPI v3 schema of the ServingRole resource."""
    properties = {
        "group": _str("Group this role belongs to (label splitserve.io/group).",
                      pattern=DNS_LABEL_PATTERN, maxLength=40),
        "role": _str("Which role.", enum=list(ROLE_NAMES)),
        **role_template_properties(),
        "model": model_schema(),
        "transfer": transfer_schema(),
        "speculative": speculative_schema(),
        "kvStore": engine_kv_store_schema(),
        "revision": _str("Revision label for the pods (set by the group; default: a hash of this spec).",
                         maxLength=63),
        "updatePartition": _int("Pods with an ordinal below this keep the old revision during a "
                                "rolling update (set by the group to bound prefill/decode skew).",
                                0, default=0),
        "peersConfigMap": _str("ConfigMap with the group's peer-discovery information.",
                               pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
        "controlSecret": _str("Secret with the group's shared control-plane key.",
                              pattern=DNS_SUBDOMAIN_PATTERN, maxLength=253),
    }
    spec = _obj(properties, "One role of one group.", required=["group", "role", "model"])
    status = _obj(
        {
            "observedGeneration": _int("metadata.generation last reconciled.", 0),
            "replicas": _int("Pods that exist.", 0),
            "readyReplicas": _int("Pods ready.", 0),
            "updatedReplicas": _int("Pods on the current revision.", 0),
            "updatedReadyReplicas": _int("Pods on the current revision and ready.", 0),
            "revision": _str("The revision the updated counts refer to."),
            "selector": _str("Label selector of the pods, for the scale subresource."),
            "conditions": _conditions(),
        },
        "Observed state.",
    )
    return _obj({"spec": spec, "status": status}, "One role of a group: a StatefulSet of engines.",
                required=["spec"])


def _crd(kind: str, plural: str, short: str, schema: Schema, columns: list[dict[str, Any]],
         subresources: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{API_GROUP}",
                     "labels": {"app.kubernetes.io/part-of": "splitserve"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": kind.lower(), "shortNames": [short], "categories": ["splitserve"]},
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": subresources,
                "additionalPrinterColumns": columns,
            }],
        },
    }


def serving_group_crd() -> dict[str, Any]:
    """The ServingGroup CustomResourceDefinition."""
    columns = [
        {"name": "Roles Ready", "type": "string", "jsonPath": ".status.rolesReady"},
        {"name": "P:D", "type": "string", "description": "Ready prefill:decode pods.", "jsonPath": ".status.pd"},
        {"name": "Desired P:D", "type": "string", "description": "Desired prefill:decode pods.",
         "jsonPath": ".status.desiredPD"},
        {"name": "Serving P:D", "type": "string",
         "description": "prefill:decode the engines serve (a pod switched at run time counts in its new role).",
         "jsonPath": ".status.planner.serving"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Planner", "type": "string", "priority": 1, "description": "The planner's last decision.",
         "jsonPath": ".status.planner.lastDecision"},
        {"name": "Router", "type": "string", "jsonPath": ".status.routerEndpoint"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _crd("ServingGroup", "servinggroups", "sg", serving_group_schema(), columns, {"status": {}})


def serving_role_crd() -> dict[str, Any]:
    """The ServingRole CustomResourceDefinition, with the scale subresource."""
    columns = [
        {"name": "Group", "type": "string", "jsonPath": ".spec.group"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Revision", "type": "string", "jsonPath": ".spec.revision", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    subresources = {
        "status": {},
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"},
    }
    return _crd("ServingRole", "servingroles", "sr", serving_role_schema(), columns, subresources)


def crd_documents() -> dict[str, str]:
    """File name to YAML text of every CRD, as written under manifests/crds and the chart."""
    header = "# Generated by `python -P -m splitserve.operator.crds --write`; do not edit.\n"
    return {
        f"{API_GROUP}_{crd['spec']['names']['plural']}.yaml":
            header + yaml.safe_dump(crd, sort_keys=False, width=100)
        for crd in (serving_group_crd(), serving_role_crd())
    }


def crd_folders(repo_root: pathlib.Path) -> list[pathlib.Path]:
    """The folders holding generated copies of the CRDs."""
    return [repo_root / "manifests" / "crds", repo_root / "charts" / "splitserve" / "crds"]


def write_crds(repo_root: pathlib.Path) -> list[pathlib.Path]:
    """Writes every CRD into every folder of :func:`crd_folders`; returns the paths written."""
    written = []
    for folder in crd_folders(repo_root):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in crd_documents().items():
            path = folder / name
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate the CRD files; ``--check``: exit 1 if any differs."""
    parser = argparse.ArgumentParser(prog="python -P -m splitserve.operator.crds")
    parser.add_argument("--repo", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.write:
        for path in write_crds(args.repo):
            log.info("wrote %s", path)
        return 0
    stale = [folder / name for folder in crd_folders(args.repo) for name, text in crd_documents().items()
             if not (folder / name).exists() or (folder / name).read_text() != text]
    for path in stale:
        log.error("stale: %s", path)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
