"""spec.kvStore against a real kube-apiserver, etcd and kube-controller-manager (its garbage collector): the
master's Deployment and Service per group or per namespace, the engines wired to its Service, bad specs refused,
and cleanup when a group stops using a store or is deleted (a namespace store outlives all but its last group)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from splitserve.operator.names import GROUP_API_VERSION

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

STORE_KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"))


def store_group(name: str, kv_store: dict[str, Any] | None) -> str:
    doc: dict[str, Any] = {
        "apiVersion": GROUP_API_VERSION, "kind": "ServingGroup", "metadata": {"name": name},
        "spec": {"model": {"name": "tiny", "builtin": "tiny"},
                 "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}},
    }
    if kv_store is not None:
        doc["spec"]["kvStore"] = kv_store
    return yaml.safe_dump(doc)


def engine_env(cluster: Any, ns: str, group: str, role: str) -> dict[str, Any]:
    sts = cluster.get("apps/v1", "StatefulSet", ns, f"{group}-{role}")
    return {} if sts is None else cluster.env_map(sts["spec"]["template"]["spec"]["containers"][0])


def owners(obj: dict[str, Any] | None) -> list[tuple[str, bool]]:
    return [] if obj is None else [(r["name"], bool(r.get("controller")))
                                   for r in obj["metadata"].get("ownerReferences") or []]


def test_a_group_store_runs_beside_the_group_wires_its_engines_and_goes_with_it(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-kvs")
    cluster.apply_yaml(ns, store_group("g", {"enabled": True, "segmentMB": 128}))
    deployment = cluster.wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "g-kv-store"), "the master")
    assert owners(deployment) == [("g", True)]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["splitserve", "kv-store"] and "50051" in container["command"]
    service = cluster.get("v1", "Service", ns, "g-kv-store")
    assert owners(service) == [("g", True)] and service["spec"]["clusterIP"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"rpc": 50051, "admin": 9003}
    address = f"g-kv-store.{ns}.svc:50051"
    for role in ("prefill", "decode"):
        env = cluster.wait_for(lambda r=role: engine_env(cluster, ns, "g", r).get("SPLITSERVE_KV_STORE") and
                               engine_env(cluster, ns, "g", r), f"{role}'s --kv-store")
        assert env["SPLITSERVE_KV_STORE"] == address and env["SPLITSERVE_KV_STORE_SEGMENT_MB"] == "128"
    cluster.wait_for(lambda: (cluster.group(ns, "g").get("status") or {}).get("kvStore") ==
                     {"name": "g-kv-store", "address": address}, "status.kvStore")
    # The master pod is one of the group's: its engine NetworkPolicy (the group's pods only) covers it.
    pods = cluster.wait_for(lambda: [p for p in cluster.children(ns, "g")["Pod"]
                                     if p["metadata"]["labels"].get("splitserve.io/role") == "kv-store"], "its pod")
    assert pods[0]["metadata"]["labels"]["splitserve.io/group"] == "g"
    # Turned off: the master goes and the engines lose their flag.
    cluster.kubectl("patch", "sg/g", "-n", ns, "--type=merge", "-p", '{"spec":{"kvStore":{"enabled":false}}}')
    cluster.wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "g-kv-store") is None
                     and cluster.get("v1", "Service", ns, "g-kv-store") is None, "the master deleted")
    cluster.wait_for(lambda: "SPLITSERVE_KV_STORE" not in engine_env(cluster, ns, "g", "decode"), "engines unwired")
    cluster.wait_for(lambda: not (cluster.group(ns, "g").get("status") or {}).get("kvStore"), "status.kvStore gone")
    # On again, then the group deleted: the garbage collector takes the master with the rest.
    cluster.kubectl("patch", "sg/g", "-n", ns, "--type=merge", "-p", '{"spec":{"kvStore":{"enabled":true}}}')
    cluster.wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "g-kv-store"), "the master again")
    cluster.kubectl("delete", "sg/g", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: all(cluster.get(v, k, ns, "g-kv-store") is None for v, k in STORE_KINDS[:2]),
                     "the master garbage-collected", timeout=90)


def test_a_namespace_store_is_shared_and_deleted_with_the_last_group_using_it(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-kvn")
    shared = {"enabled": True, "scope": "namespace", "name": "pool", "port": 50100}
    cluster.apply_yaml(ns, store_group("a", shared))
    cluster.wait_for(lambda: owners(cluster.get("apps/v1", "Deployment", ns, "pool")) == [("a", False)],
                     "the shared master, owned by a")
    # Another group joins with other settings: it keeps a's (port 50100) and becomes an owner too.
    cluster.apply_yaml(ns, store_group("b", {**shared, "port": 50999}))
    cluster.apply_yaml(ns, store_group("c", shared))

    def owned_by_all(names: set[str]) -> bool:
        return all({n for n, _ in owners(cluster.get(v, k, ns, "pool"))} == names for v, k in STORE_KINDS)

    cluster.wait_for(lambda: owned_by_all({"a", "b", "c"}), "the store owned by a, b and c")
    service = cluster.get("v1", "Service", ns, "pool")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["rpc"] == 50100
    assert not any(controller for _, controller in owners(service))
    for group in ("a", "b", "c"):
        env = cluster.wait_for(lambda g=group: engine_env(cluster, ns, g, "decode").get("SPLITSERVE_KV_STORE") and
                               engine_env(cluster, ns, g, "decode"), f"{group}'s engines wired")
        assert env["SPLITSERVE_KV_STORE"] == f"pool.{ns}.svc:50100"
        sts = cluster.get("apps/v1", "StatefulSet", ns, f"{group}-decode")
        assert sts["spec"]["template"]["metadata"]["labels"]["splitserve.io/kv-store"] == "pool"
        policy = cluster.get("networking.k8s.io/v1", "NetworkPolicy", ns, f"{group}-engines")
        assert {"from": [{"podSelector": {"matchLabels": {"splitserve.io/kv-store": "pool"}}}]} in \
            policy["spec"]["ingress"]
    # c stops using it: its reference goes, the store stays.
    cluster.kubectl("patch", "sg/c", "-n", ns, "--type=merge", "-p", '{"spec":{"kvStore":null}}')
    cluster.wait_for(lambda: owned_by_all({"a", "b"}), "c's reference taken off")
    cluster.wait_for(lambda: "SPLITSERVE_KV_STORE" not in engine_env(cluster, ns, "c", "decode"), "c unwired")
    # a deleted: the garbage collector drops its reference and keeps the store for b.
    cluster.kubectl("delete", "sg/a", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: owned_by_all({"b"}), "a's reference gone, the store kept for b", timeout=90)
    # b, the last, deleted: the store goes.
    cluster.kubectl("delete", "sg/b", "-n", ns, "--wait=false")
    cluster.wait_for(lambda: all(cluster.get(v, k, ns, "pool") is None for v, k in STORE_KINDS),
                     "the store garbage-collected with its last group", timeout=90)


def test_groups_created_together_both_own_the_namespace_store_they_race_to_create(cluster: Any,
                                                                                  operator: Any) -> None:
    ns = cluster.namespace("op-kvr")
    shared = {"enabled": True, "scope": "namespace"}
    cluster.apply_yaml(ns, "---\n".join(store_group(g, shared) for g in ("gx", "gy", "gz")))

    def owners_of_all() -> set[str] | None:
        found = [{n for n, _ in owners(cluster.get(v, k, ns, "splitserve-kv-store"))} for v, k in STORE_KINDS]
        return found[0] if all(f == found[0] for f in found) else None

    cluster.wait_for(lambda: owners_of_all() == {"gx", "gy", "gz"}, "every group an owner of the one store")
    service = cluster.get("v1", "Service", ns, "splitserve-kv-store")
    for group in ("gx", "gy", "gz"):
        cluster.wait_for(lambda g=group: engine_env(cluster, ns, g, "prefill").get("SPLITSERVE_KV_STORE") ==
                         f"splitserve-kv-store.{ns}.svc:50051", f"{group} wired")
    assert owners_of_all() == {"gx", "gy", "gz"} and service["spec"]["ports"][0]["port"] == 50051


def test_bad_kv_store_specs_are_refused_naming_the_field(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-kvbad")
    for kv_store, field in (({"enabled": True, "scope": "cluster"}, "spec.kvStore.scope"),
                            ({"enabled": True, "port": 80}, "spec.kvStore.port"),
                            ({"enabled": True, "segmentMB": -1}, "spec.kvStore.segmentMB"),
                            ({"enabled": True, "scope": "namespace", "name": "Not_A_Name"}, "spec.kvStore.name")):
        refused = cluster.kubectl("apply", "-n", ns, "-f", "-", input=store_group("bad", kv_store), check=False)
        assert refused.returncode != 0 and field in refused.stderr, (kv_store, refused.stderr)
    # What the schema cannot see: a store name without the namespace scope, a flag the store sets.
    doc = yaml.safe_load(store_group("bad", {"enabled": True, "name": "pool"}))
    doc["spec"]["roles"]["decode"]["engineArgs"] = ["--kv-store=10.1.2.3:50051"]
    cluster.apply_yaml(ns, yaml.safe_dump(doc))
    degraded = cluster.wait_for(lambda: cluster.condition(ns, "bad", "Degraded").get("status") == "True"
                                and cluster.condition(ns, "bad", "Degraded"), "Degraded=True")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.kvStore.name" in degraded["message"] and "engineArgs[0] sets --kv-store" in degraded["message"]
    assert cluster.get("apps/v1", "Deployment", ns, "bad-kv-store") is None
    assert cluster.get("apps/v1", "Deployment", ns, "pool") is None
