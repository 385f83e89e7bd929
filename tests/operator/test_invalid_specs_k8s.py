"""Bad specs are refused by `kubectl apply` with a message naming the field (real API server)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.k8s]

VALID_GROUP: dict[str, Any] = {
    "apiVersion": "splitserve.io/v1alpha1",
    "kind": "ServingGroup",
    "metadata": {"name": "bad"},
    "spec": {
        "model": {"name": "m", "imagePath": "/opt/m"},
        "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    },
}
VALID_ROLE: dict[str, Any] = {
    "apiVersion": "splitserve.io/v1alpha1",
    "kind": "ServingRole",
    "metadata": {"name": "bad-role"},
    "spec": {"group": "g", "role": "decode", "model": {"name": "m", "imagePath": "/opt/m"}},
}


def edit(base: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    change(doc)
    return doc


def spec_set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Sets spec.<dotted path> (creating objects on the way)."""
    def change(doc: dict[str, Any]) -> None:
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return change


def spec_del(path: str) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node = doc["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        del node[leaf]
    return change


# A missing required field is refused by kubectl's own validation (against the schema the
# server publishes) or, when kubectl has not fetched that schema yet, by the server.
REQUIRED = 'ValidationError({parent}): missing required field "{field}" || {path}: Required value'

# (id, document, fragments the error must contain; " || " separates alternatives)
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("no-model", edit(VALID_GROUP, spec_del("model")),
     [REQUIRED.format(field="model", parent="ServingGroup.spec", path="spec.model")]),
    ("no-roles", edit(VALID_GROUP, spec_del("roles")),
     [REQUIRED.format(field="roles", parent="ServingGroup.spec", path="spec.roles")]),
    ("no-decode", edit(VALID_GROUP, spec_del("roles.decode")),
     [REQUIRED.format(field="decode", parent="ServingGroup.spec.roles", path="spec.roles.decode")]),
    ("model-without-source", edit(VALID_GROUP, spec_del("model.imagePath")), ["spec.model", "oneOf"]),
    ("model-two-sources", edit(VALID_GROUP, spec_set("model.hostPath", {"path": "/data/m"})),
     ["spec.model", "oneOf"]),
    ("model-no-name", edit(VALID_GROUP, spec_del("model.name")),
     [REQUIRED.format(field="name", parent="ServingGroup.spec.model", path="spec.model.name")]),
    ("model-name-spaces", edit(VALID_GROUP, spec_set("model.name", "my model")), ["spec.model.name", "should match"]),
    ("pvc-no-claim", edit(edit(VALID_GROUP, spec_del("model.imagePath")), spec_set("model.pvc", {"subPath": "x"})),
     [REQUIRED.format(field="claimName", parent="ServingGroup.spec.model.pvc",
                      path="spec.model.pvc.claimName")]),
    ("hostpath-relative", edit(edit(VALID_GROUP, spec_del("model.imagePath")),
                               spec_set("model.hostPath", {"path": "data/m"})),
     ["spec.model.hostPath.path", "should match"]),
    ("replicas-negative", edit(VALID_GROUP, spec_set("roles.prefill.replicas", -1)),
     ["spec.roles.prefill.replicas", "greater than or equal to 0"]),
    ("replicas-huge", edit(VALID_GROUP, spec_set("roles.decode.replicas", 100000)),
     ["spec.roles.decode.replicas", "less than or equal to 1000"]),
    ("replicas-string", edit(VALID_GROUP, spec_set("roles.decode.replicas", "two")),
     ["spec.roles.decode.replicas", "integer"]),
    ("tp-3", edit(VALID_GROUP, spec_set("roles.decode.tensorParallelSize", 3)),
     ["spec.roles.decode.tensorParallelSize", "supported values"]),
    ("protocol-udp", edit(VALID_GROUP, spec_set("transfer.protocol", "udp")),
     ["spec.transfer.protocol", "supported values", "rdma"]),
    ("device-with-space", edit(VALID_GROUP, spec_set("transfer.devices", ["mlx5 0"])),
     ["spec.transfer.devices", "should match"]),
    ("bootstrap-port-high", edit(VALID_GROUP, spec_set("transfer.bootstrapPort", 70000)),
     ["spec.transfer.bootstrapPort", "less than or equal to 65535"]),
    ("bootstrap-port-privileged", edit(VALID_GROUP, spec_set("transfer.bootstrapPort", 80)),
     ["spec.transfer.bootstrapPort", "greater than or equal to 1024"]),
    ("draft-tokens-zero", edit(VALID_GROUP, spec_set("speculative.numDraftTokens", 0)),
     ["spec.speculative.numDraftTokens", "greater than or equal to 1"]),
    ("gpus-negative", edit(VALID_GROUP, spec_set("roles.prefill.resources", {"gpus": -1})),
     ["spec.roles.prefill.resources.gpus", "greater than or equal to 0"]),
    ("memory-not-a-quantity", edit(VALID_GROUP, spec_set("roles.prefill.resources", {"limits": {"memory": "lots"}})),
     ["spec.roles.prefill.resources.limits.memory", "should match"]),
    ("toleration-operator", edit(VALID_GROUP, spec_set("roles.decode.tolerations", [{"operator": "Sometimes"}])),
     ["spec.roles.decode.tolerations.operator", "supported values"]),
    ("toleration-effect", edit(VALID_GROUP, spec_set("roles.decode.tolerations",
                                                     [{"key": "k", "operator": "Exists", "effect": "Never"}])),
     ["spec.roles.decode.tolerations.effect", "supported values"]),
    ("engine-arg-not-a-flag", edit(VALID_GROUP, spec_set("roles.decode.engineArgs", ["max-batch=4"])),
     ["spec.roles.decode.engineArgs", "should match"]),
    ("dtype-float8", edit(VALID_GROUP, spec_set("roles.decode.dtype", "float8")),
     ["spec.roles.decode.dtype", "supported values"]),
    ("page-size-zero", edit(VALID_GROUP, spec_set("roles.decode.pageSize", 0)),
     ["spec.roles.decode.pageSize", "greater than or equal to 1"]),
    ("env-name", edit(VALID_GROUP, spec_set("roles.decode.env", [{"name": "1BAD", "value": "x"}])),
     ["spec.roles.decode.env.name", "should match"]),
    ("node-selector-not-string", edit(VALID_GROUP, spec_set("roles.decode.nodeSelector", {"zone": 5})),
     ["spec.roles.decode.nodeSelector.zone", "string"]),
    ("image-empty", edit(VALID_GROUP, spec_set("image", "")), ["spec.image", "at least 1 chars"]),
    ("pull-policy", edit(VALID_GROUP, spec_set("imagePullPolicy", "Sometimes")),
     ["spec.imagePullPolicy", "supported values"]),
    ("router-service-type", edit(VALID_GROUP, spec_set("router.serviceType", "Ingress")),
     ["spec.router.serviceType", "supported values"]),
    ("router-port-zero", edit(VALID_GROUP, spec_set("router.port", 0)),
     ["spec.router.port", "greater than or equal to 1"]),
    ("router-api-key-secret-without-name", edit(VALID_GROUP, spec_set("router.apiKeySecret", {"key": "k"})),
     ["spec.router.apiKeySecret", "name", "required || Required"]),
    ("skew-over-100", edit(VALID_GROUP, spec_set("rollout.maxSkewPercent", 150)),
     ["spec.rollout.maxSkewPercent", "less than or equal to 100"]),
    ("slo-without-ttft", edit(VALID_GROUP, spec_set("slo", {"enabled": True, "itlSeconds": 0.05})),
     [REQUIRED.format(field="ttftSeconds", parent="ServingGroup.spec.slo", path="spec.slo.ttftSeconds")]),
    ("slo-ttft-zero", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 0, "itlSeconds": 0.05})),
     ["spec.slo.ttftSeconds", "greater than 0"]),
    ("slo-itl-negative", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": -0.1})),
     ["spec.slo.itlSeconds", "greater than 0"]),
    ("slo-ttft-string", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": "fast", "itlSeconds": 0.05})),
     ["spec.slo.ttftSeconds", "number"]),
    ("slo-percentile-100", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                              "percentile": 100})),
     ["spec.slo.percentile", "less than or equal to 99"]),
    ("slo-percentile-low", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                              "percentile": 10})),
     ["spec.slo.percentile", "greater than or equal to 50"]),
    ("slo-interval-short", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                              "intervalSeconds": 1})),
     ["spec.slo.intervalSeconds", "greater than or equal to 5"]),
    ("slo-min-zero", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                        "roles": {"decode": {"minReplicas": 0}}})),
     ["spec.slo.roles.decode.minReplicas", "greater than or equal to 1"]),
    ("slo-max-huge", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                        "roles": {"prefill": {"maxReplicas": 5000}}})),
     ["spec.slo.roles.prefill.maxReplicas", "less than or equal to 1000"]),
    ("slo-enabled-string", edit(VALID_GROUP, spec_set("slo", {"ttftSeconds": 1, "itlSeconds": 0.05,
                                                              "enabled": "yes"})),
     ["spec.slo.enabled", "boolean"]),
    ("drain-negative", edit(VALID_GROUP, spec_set("roles.decode.drainSeconds", -1)),
     ["spec.roles.decode.drainSeconds", "greater than or equal to 0"]),
    ("role-kind", edit(VALID_ROLE, spec_set("role", "cook")), ["spec.role", "supported values"]),
    ("role-replicas-negative", edit(VALID_ROLE, spec_set("replicas", -2)),
     ["spec.replicas", "greater than or equal to 0"]),
    ("role-without-model", edit(VALID_ROLE, spec_del("model")),
     [REQUIRED.format(field="model", parent="ServingRole.spec", path="spec.model")]),
    ("role-group-not-dns", edit(VALID_ROLE, spec_set("group", "Not_DNS")), ["spec.group", "should match"]),
]


def test_there_are_at_least_twenty_refused_specs() -> None:
    assert len(CASES) >= 20


@pytest.mark.parametrize(("doc", "fragments"), [(d, f) for _, d, f in CASES], ids=[c[0] for c in CASES])
def test_kubectl_apply_refuses_a_bad_spec_naming_the_field(cluster: Any, doc: dict[str, Any],
                                                            fragments: list[str]) -> None:
    result = cluster.kubectl("apply", "-n", "default", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0, f"accepted: {yaml.safe_dump(doc)}"
    for fragment in fragments:
        assert any(alt in result.stderr for alt in fragment.split(" || ")), result.stderr
    kind = "sg" if doc["kind"] == "ServingGroup" else "sr"
    assert cluster.kubectl("get", kind, doc["metadata"]["name"], "-n", "default", check=False).returncode != 0


def test_the_valid_base_documents_are_accepted(cluster: Any) -> None:
    ns = cluster.namespace("valid")
    for doc in (VALID_GROUP, VALID_ROLE):
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    assert cluster.kubectl("get", "sg", "bad", "-n", ns, "-o", "jsonpath={.spec.rollout.maxSkewPercent}").stdout == "25"


def test_a_valid_slo_is_accepted_with_its_defaults(cluster: Any) -> None:
    ns = cluster.namespace("valid-slo")
    doc = edit(VALID_GROUP, spec_set("slo", {"enabled": True, "ttftSeconds": 2, "itlSeconds": 0.05}))
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    slo = cluster.get("splitserve.io/v1alpha1", "ServingGroup", ns, "bad")["spec"]["slo"]
    assert slo["percentile"] == 90 and slo["intervalSeconds"] == 15 and slo["startupSeconds"] == 120
    assert slo["roles"] == {"prefill": {"minReplicas": 1, "maxReplicas": 8},
                            "decode": {"minReplicas": 1, "maxReplicas": 8}}


def test_the_server_refuses_a_missing_field_without_kubectl_validation(cluster: Any) -> None:
    doc = edit(VALID_GROUP, spec_del("model"))
    result = cluster.kubectl("apply", "--validate=false", "-n", "default", "-f", "-", input=yaml.safe_dump(doc),
                             check=False)
    assert result.returncode != 0
    assert "spec.model: Required value" in result.stderr, result.stderr


def test_kubectl_refuses_a_misspelt_field(cluster: Any) -> None:
    doc = edit(VALID_GROUP, spec_set("roles.decode.replica", 2))
    result = cluster.kubectl("apply", "-n", "default", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert 'unknown field "replica"' in result.stderr, result.stderr
