"""The apply decision logic and the generated CRD files: no cluster."""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from splitserve.operator.crds import crd_documents, crd_folders, serving_group_schema
from splitserve.operator.kube import merge_for_update, needs_update, with_applied_hash
from splitserve.operator.names import ANNOTATION_APPLIED_HASH

REPO = pathlib.Path(__file__).resolve().parents[2]


def configmap(data: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "n", "labels": labels or {"a": "1"}}, "data": data}


def test_an_object_as_the_server_returns_it_needs_no_update() -> None:
    desired = with_applied_hash(configmap({"k": "v"}))
    existing = {**desired, "metadata": {**desired["metadata"], "resourceVersion": "5", "uid": "u",
                                        "labels": {"a": "1", "added-by-someone": "x"}}}
    assert not needs_update(existing, with_applied_hash(configmap({"k": "v"})))


def test_a_removed_key_is_seen_through_the_applied_hash() -> None:
    existing = with_applied_hash(configmap({"k": "v", "gone": "x"}))
    desired = with_applied_hash(configmap({"k": "v"}))
    assert desired["metadata"]["annotations"][ANNOTATION_APPLIED_HASH] != \
        existing["metadata"]["annotations"][ANNOTATION_APPLIED_HASH]
    assert needs_update(existing, desired)
    merged = merge_for_update({**existing, "status": {"x": 1}}, desired)
    assert merged["data"] == {"k": "v"}
    assert "status" not in merged


def test_drift_made_by_hand_is_repaired() -> None:
    existing = with_applied_hash(configmap({"k": "v"}))
    existing["data"]["k"] = "edited by hand"
    assert needs_update(existing, with_applied_hash(configmap({"k": "v"})))


def test_secret_data_is_written_once() -> None:
    def secret(key: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "n"},
                "data": {"key": key}}
    existing = with_applied_hash(secret("b2xk"))
    desired = with_applied_hash(secret("bmV3"))
    assert not needs_update(existing, desired)
    existing["metadata"]["labels"] = {}
    desired["metadata"]["labels"] = {"x": "y"}
    assert merge_for_update(existing, desired)["data"] == {"key": "b2xk"}


def test_generated_crd_files_match_the_schema_module() -> None:
    """Fails when manifests/crds or charts/splitserve/crds drift from splitserve.operator.crds.

    Regenerate with: python -P -m splitserve.operator.crds --write
    """
    for folder in crd_folders(REPO):
        for name, text in crd_documents().items():
            path = folder / name
            assert path.exists(), f"{path} is missing; run python -P -m splitserve.operator.crds --write"
            assert path.read_text() == text, f"{path} drifted; run python -P -m splitserve.operator.crds --write"


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], f"{path}[]")
    return out


def test_every_schema_node_is_typed_and_documented_and_nothing_is_left_open() -> None:
    for path, node in _walk(serving_group_schema()):
        assert "type" in node, f"{path} has no type"
        assert node.get("description"), f"{path} has no description"
        assert not node.get("x-kubernetes-preserve-unknown-fields"), f"{path} keeps unknown fields"


def test_crds_are_apiextensions_v1_with_status_scale_and_printer_columns() -> None:
    docs = {name: yaml.safe_load(text) for name, text in crd_documents().items()}
    group = docs["splitserve.io_servinggroups.yaml"]
    role = docs["splitserve.io_servingroles.yaml"]
    for crd in (group, role):
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        assert crd["spec"]["versions"][0]["subresources"]["status"] == {}
    assert group["spec"]["names"]["shortNames"] == ["sg"]
    assert role["spec"]["names"]["shortNames"] == ["sr"]
    assert role["spec"]["versions"][0]["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    columns = [c["name"] for c in group["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Roles Ready", "P:D", "Desired P:D", "Serving P:D", "Ready", "Planner", "Router", "Age"]
