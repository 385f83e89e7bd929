"""spec.kvStore without a cluster: the master's objects per group or per namespace, their owners, the engines'
wiring (env, pod labels, NetworkPolicies), the revision and the validation."""

from __future__ import annotations

import copy
from typing import Any

from splitserve.launcher.kv_store import KVStoreMasterConfig, master_argv
from splitserve.operator.group_builders import build_engine_network_policy, build_serving_role
from splitserve.operator.kv_store_builders import build_kv_store, engine_kv_store, owner_references, shared_port
from splitserve.operator.names import LABEL_GROUP, LABEL_KV_STORE, LABEL_ROLE
from splitserve.operator.role_builders import build_statefulset
from splitserve.operator.rollout import group_revision
from splitserve.operator.validation import group_spec_problems, role_spec_problems

IMAGE = "example.com/splitserve:test"


def group(**spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "m", "builtin": "tiny"},
        "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
    }
    spec.update(spec_overrides)
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 1}, "spec": spec}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def with_store(group_name: str = "g", **kv: Any) -> dict[str, Any]:
    body = group(kvStore={"enabled": True, **kv})
    body["metadata"].update(name=group_name, uid=f"uid-{group_name}")
    return body


def engine_pod(body: dict[str, Any], role: str, port: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    sr = build_serving_role(body, role, group_revision(body["spec"]), 0, None, engine_kv_store(body, port))
    sts = build_statefulset(sr, IMAGE)
    return sts["spec"]["template"]["metadata"]["labels"], env_of(sts["spec"]["template"]["spec"]["containers"][0])


def test_a_group_store_is_a_master_deployment_and_service_the_group_owns() -> None:
    body = with_store(port=50100, segmentMB=256, resources={"requests": {"memory": "1Gi"}})
    service, deployment = build_kv_store(body, IMAGE)
    assert [o["kind"] for o in (service, deployment)] == ["Service", "Deployment"]
    for obj in (service, deployment):
        assert obj["metadata"]["name"] == "g-kv-store" and obj["metadata"]["namespace"] == "ns"
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("ServingGroup", "uid-g", True)
        assert obj["metadata"]["labels"][LABEL_GROUP] == "g" and obj["metadata"]["labels"][LABEL_ROLE] == "kv-store"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == {
        LABEL_GROUP: "g", LABEL_ROLE: "kv-store"}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"rpc": 50100, "admin": 9003}
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # never two masters
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["splitserve", "kv-store", "--host", "0.0.0.0", "--port", "50100",
                                    "--admin-port", "9003"]
    assert container["image"] == IMAGE and container["resources"] == {"requests": {"memory": "1Gi"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    # The pod is one of the group's (not its router): the group's engine policy admits only the group to it.
    policy = build_engine_network_policy(body)
    labels = spec["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"][LABEL_GROUP] == labels[LABEL_GROUP]
    assert labels[LABEL_ROLE] not in policy["spec"]["podSelector"]["matchExpressions"][0]["values"]
    assert len(policy["spec"]["ingress"]) == 1
    # No store: nothing built, nothing wired.
    assert build_kv_store(group(), IMAGE) == [] and engine_kv_store(group()) is None
    assert build_kv_store(group(kvStore={"enabled": False}), IMAGE) == []


def test_prefill_and_decode_engines_point_at_the_store_service() -> None:
    body = with_store(segmentMB=256)
    for role in ("prefill", "decode"):
        labels, env = engine_pod(body, role)
        assert env["SPLITSERVE_KV_STORE"] == "g-kv-store.ns.svc:50051"
        assert env["SPLITSERVE_KV_STORE_SEGMENT_MB"] == "256"
        assert LABEL_KV_STORE not in labels
    drafter = copy.deepcopy(body)
    drafter["spec"]["roles"]["drafter"] = {"replicas": 1}
    drafter["spec"]["speculative"] = {"numDraftTokens": 4}
    _, env = engine_pod(drafter, "drafter")  # a model of its own, no prefix worth sharing
    assert "SPLITSERVE_KV_STORE" not in env
    _, env = engine_pod(group(), "decode")
    assert "SPLITSERVE_KV_STORE" not in env and "SPLITSERVE_KV_STORE_SEGMENT_MB" not in env


def test_the_store_s_master_settings_do_not_roll_the_engines_but_its_address_does() -> None:
    base = group_revision(with_store()["spec"])
    assert group_revision(with_store(resources={"requests": {"cpu": "2"}}, image="other:1")["spec"]) == base
    assert group_revision(with_store(port=50200)["spec"]) != base
    assert group_revision(with_store(segmentMB=64)["spec"]) != base
    assert group_revision(group()["spec"]) != base


def test_a_namespace_store_is_shared_and_owned_by_every_group_using_it() -> None:
    a = with_store("a", scope="namespace", port=50300)
    b = with_store("b", scope="namespace", port=50999, image="ignored:1")
    policy, service, deployment = build_kv_store(a, IMAGE)
    assert [o["metadata"]["name"] for o in (policy, service, deployment)] == ["splitserve-kv-store"] * 3
    for obj in (policy, service, deployment):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == ("uid-a", False)  # an owner, not the controller
        assert LABEL_GROUP not in obj["metadata"]["labels"]
        assert obj["metadata"]["labels"][LABEL_KV_STORE] == "splitserve-kv-store"
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        LABEL_KV_STORE: "splitserve-kv-store"}}}]}]
    # b joins it as a created: a's port and image stay, both groups own it, and b's engines use a's port.
    created = {o["kind"]: {**o, "metadata": {**o["metadata"], "uid": "x", "resourceVersion": "7"}}
               for o in (policy, service, deployment)}
    joined = build_kv_store(b, IMAGE, created)
    for obj in joined:
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == ["uid-a", "uid-b"]
        assert "uid" not in obj["metadata"] and "resourceVersion" not in obj["metadata"]
        assert obj["spec"] == created[obj["kind"]]["spec"]
    assert shared_port(created) == 50300
    wired = engine_kv_store(b, shared_port(created))
    assert wired == {"address": "splitserve-kv-store.ns.svc:50300", "segmentMB": 512, "name": "splitserve-kv-store"}
    # Rebuilt by either group from the object as it now is: the same owners, in the same order.
    both = {o["kind"]: o for o in joined}
    assert [o["metadata"]["ownerReferences"] for o in build_kv_store(a, IMAGE, both)] == \
        [o["metadata"]["ownerReferences"] for o in joined]
    # A group leaving takes only its own reference off.
    assert [r["uid"] for r in owner_references(a, both["Deployment"], keep=False)] == ["uid-b"]
    # Its engines carry the store's label, and every group's engine policy admits the store's engines.
    labels, env = engine_pod(b, "decode", shared_port(created))
    assert labels[LABEL_KV_STORE] == "splitserve-kv-store" and env["SPLITSERVE_KV_STORE"] == wired["address"]
    ingress = build_engine_network_policy(b)["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {LABEL_KV_STORE: "splitserve-kv-store"}}}]} in ingress
    named = with_store("c", scope="namespace", name="shared-2")
    assert build_kv_store(named, IMAGE)[0]["metadata"]["name"] == "shared-2"


def test_kv_store_specs_that_cannot_work_are_refused_with_their_field() -> None:
    assert group_spec_problems("g", with_store()["spec"]) == []
    assert group_spec_problems("g", with_store(scope="namespace", name="s")["spec"]) == []
    (problem,) = group_spec_problems("g", with_store(name="s")["spec"])
    assert "spec.kvStore.name" in problem and "scope" in problem
    body = with_store()
    body["spec"]["roles"]["decode"]["engineArgs"] = ["--kv-store=10.0.0.1:5", "--max-running-requests=8"]
    body["spec"]["roles"]["prefill"]["env"] = [{"name": "SPLITSERVE_KV_STORE_SEGMENT_MB", "value": "1"}]
    problems = group_spec_problems("g", body["spec"])
    assert any("spec.roles.decode.engineArgs[0] sets --kv-store" in p for p in problems)
    assert any("spec.roles.prefill.env[0] sets SPLITSERVE_KV_STORE_SEGMENT_MB" in p for p in problems)
    # Without spec.kvStore an engine may name a store of its own.
    body["spec"]["kvStore"]["enabled"] = False
    assert group_spec_problems("g", body["spec"]) == []
    # A ServingRole of its own with spec.kvStore: the same.
    role = {"group": "g", "role": "decode", "model": {"name": "m", "builtin": "tiny"},
            "kvStore": {"address": "s.ns.svc:50051"}, "engineArgs": ["--kv-store-segment-mb=9"]}
    (problem,) = role_spec_problems("g-decode", role)
    assert "spec.engineArgs[0] sets --kv-store-segment-mb" in problem
    assert role_spec_problems("g-decode", {**role, "engineArgs": []}) == []


def test_the_kv_store_command_runs_mooncake_master_on_the_pod_s_ports() -> None:
    argv = master_argv(KVStoreMasterConfig(host="0.0.0.0", port=50100, admin_port=9003))
    assert argv[0].endswith("mooncake_master")
    assert {"--rpc_address=0.0.0.0", "--rpc_port=50100", "--metrics_port=9003"} <= set(argv)
    for bad in ({"port": 0}, {"admin_port": 70000}, {"port": 9003}):
        try:
            KVStoreMasterConfig(**bad)
        except ValueError as exc:
            assert "port" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
