"""The operator against a real kube-apiserver, etcd and kube-controller-manager.

There is no kubelet: pods are created by the StatefulSet and Deployment controllers but
never run; tests that need readiness mark pods ready by patching their status.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml

from splitserve.operator.kube import collection_path
from splitserve.operator.names import GROUP_API_VERSION, LABEL_REVISION, LABEL_ROLE

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

EXAMPLE_ROLES = {
    "1p1d": ("qwen-1p1d", ["prefill", "decode"]),
    "2p4d-tp2": ("llama-2p4d", ["prefill", "decode"]),
    "epd": ("llava-epd", ["prefill", "decode", "encode"]),
    "decode-drafter": ("llama-spec", ["prefill", "decode", "drafter"]),
}

SMALL_GROUP = """
apiVersion: splitserve.io/v1alpha1
kind: ServingGroup
metadata:
  name: {name}
spec:
  model:
    name: tiny
    imagePath: /opt/models/tiny
  roles:
    prefill:
      replicas: {prefill}
    decode:
      replicas: {decode}
  rollout:
    maxSkewPercent: {skew}
"""


def small_group(name: str, prefill: int = 1, decode: int = 1, skew: int = 25) -> str:
    return SMALL_GROUP.format(name=name, prefill=prefill, decode=decode, skew=skew)


def owner_names(obj: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["kind"], r["name"]) for r in obj["metadata"].get("ownerReferences") or []]


def test_crds_are_established_with_short_names(cluster: Any) -> None:
    for crd in ("servinggroups.splitserve.io", "servingroles.splitserve.io"):
        out = cluster.kubectl("get", "crd", crd, "-o",
                              "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
        assert out == "True", crd
    names = cluster.kubectl("api-resources", "--api-group=splitserve.io", "-o", "name").stdout.split()
    assert sorted(names) == ["servinggroups.splitserve.io", "servingroles.splitserve.io"]


@pytest.mark.parametrize("example_name", sorted(EXAMPLE_ROLES))
def test_example_applies_and_every_child_is_owned_and_configured(cluster: Any, operator: Any,
                                                                 example_name: str) -> None:
    group_name, roles = EXAMPLE_ROLES[example_name]
    ns = cluster.namespace("op-ex")
    cluster.apply_yaml(ns, cluster.example(example_name))
    group = cluster.group(ns, group_name)
    # Server-side defaults from the schema.
    assert group["spec"]["transfer"]["bootstrapPort"] == 8998
    assert group["spec"]["transfer"]["embeddingPort"] == 8999
    assert group["spec"]["router"]["serviceType"] == "ClusterIP"

    def converged() -> dict[str, list[dict[str, Any]]] | None:
        kids = cluster.children(ns, group_name)
        ok = (len(kids["ServingRole"]) == len(roles) and len(kids["StatefulSet"]) == len(roles)
              and len(kids["Deployment"]) == 1 and len(kids["ConfigMap"]) == 1 and len(kids["Secret"]) == 1
              and len(kids["Service"]) == 2 * len(roles) + 1)  # per role: peers and serving
        return kids if ok else None

    kids = cluster.wait_for(converged, f"children of {example_name}")
    group = cluster.group(ns, group_name)
    uid = group["metadata"]["uid"]
    for kind in ("ServingRole", "Deployment", "ConfigMap", "Secret"):
        for obj in kids[kind]:
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, f"{kind} {obj['metadata']['name']}"
            assert obj["metadata"]["ownerReferences"][0]["controller"] is True
    roles_by_name = {sr["metadata"]["name"]: sr for sr in kids["ServingRole"]}
    assert sorted(roles_by_name) == sorted(f"{group_name}-{r}" for r in roles)
    for sts in kids["StatefulSet"]:
        name = sts["metadata"]["name"]
        assert owner_names(sts) == [("ServingRole", name)]
        assert sts["metadata"]["ownerReferences"][0]["uid"] == roles_by_name[name]["metadata"]["uid"]
        role = sts["metadata"]["labels"][LABEL_ROLE]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["command"][:4] == ["splitserve", "serve", "--role", role]
        env = cluster.env_map(container)
        assert env["SPLITSERVE_GROUP"] == group_name
        assert env["SPLITSERVE_ROLE"] == role
        assert env["SPLITSERVE_BOOTSTRAP_PORT"] == "8998"
        assert env["SPLITSERVE_TRANSFER_CONTROL_KEY"] == {
            "secretKeyRef": {"name": f"{group_name}-control", "key": "key"}}
        assert env["SPLITSERVE_TRANSFER_HOST"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["SPLITSERVE_REPLICA_INDEX"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
        assert sts["spec"]["template"]["metadata"]["labels"][LABEL_REVISION] == group["status"]["revision"]
        if role == "prefill":
            assert "--bootstrap-port" in container["command"]
        if role in ("encode", "prefill"):  # the image embedding transfer's fixed control port
            assert container["command"][container["command"].index("--embedding-control-port") + 1] == "8999"
            assert {"name": "embedding", "containerPort": 8999, "protocol": "TCP"} in container["ports"]
    services = {s["metadata"]["name"]: s for s in kids["Service"]}
    for r in roles:
        assert services[f"{group_name}-{r}"]["spec"]["clusterIP"] == "None"
        assert owner_names(services[f"{group_name}-{r}"]) == [("ServingRole", f"{group_name}-{r}")]
        # The router routes by the serving Service's Endpoints (ready, not terminating pods) only.
        assert "splitserve.io/role" not in services[f"{group_name}-{r}"]["metadata"]["labels"]
        assert services[f"{group_name}-{r}-serving"]["metadata"]["labels"]["splitserve.io/role"] == r
    assert services[f"{group_name}-router"]["spec"]["ports"][0]["port"] == 8000
    if "encode" in roles:
        assert [p["name"] for p in services[f"{group_name}-encode"]["spec"]["ports"]] == ["http", "embedding"]
    peers = json.loads(kids["ConfigMap"][0]["data"]["peers.json"])
    assert sorted(peers["roles"]) == sorted(roles)
    if example_name == "decode-drafter":
        drafter = next(s for s in kids["StatefulSet"] if s["metadata"]["name"].endswith("-drafter"))
        command = drafter["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--model") + 1] == "/opt/models/Llama-3.2-1B-Instruct"
    # The StatefulSet controller made the pods (they never run: there is no kubelet).
    expected_pods = sum(roles_by_name[f"{group_name}-{r}"]["spec"]["replicas"] for r in roles) + \
        group["spec"]["router"]["replicas"]
    cluster.wait_for(lambda: len(cluster.children(ns, group_name)["Pod"]) == expected_pods,
                     f"{expected_pods} pods")


def test_status_and_conditions_converge_once_pods_are_ready(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-status")
    cluster.apply_yaml(ns, small_group("s", prefill=1, decode=2))
    progressing = cluster.wait_for(lambda: cluster.condition(ns, "s", "Progressing").get("status") == "True",
                                   "Progressing=True before pods are ready")
    assert progressing
    assert cluster.condition(ns, "s", "Ready")["status"] == "False"
    cluster.wait_for(lambda: cluster.condition(ns, "s", "Ready").get("status") == "True",
                     "Ready=True", ready_pods_in=ns)
    status = cluster.group(ns, "s")["status"]
    assert status["rolesReady"] == "prefill 1/1, decode 2/2"
    assert status["roles"]["decode"] == {"desired": 2, "ready": 2, "updated": 2}
    assert status["routerEndpoint"] == f"http://s-router.{ns}.svc:8000"
    assert status["observedGeneration"] == cluster.group(ns, "s")["metadata"]["generation"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Progressing"]["status"] == "False"
    assert conditions["Progressing"]["reason"] == "Converged"
    assert conditions["Degraded"]["status"] == "False"
    role = cluster.get(GROUP_API_VERSION, "ServingRole", ns, "s-decode")
    assert role["status"]["readyReplicas"] == 2
    assert role["status"]["selector"] == "splitserve.io/group=s,splitserve.io/role=decode"
    table = cluster.kubectl("get", "sg", "s", "-n", ns).stdout
    assert "prefill 1/1, decode 2/2" in table and f"http://s-router.{ns}.svc:8000" in table
    assert "True" in table.splitlines()[1]


def test_kubectl_scale_on_a_role_resizes_its_statefulset_and_the_group_keeps_it(cluster: Any,
                                                                                operator: Any) -> None:
    ns = cluster.namespace("op-scale")
    cluster.apply_yaml(ns, small_group("sc"))
    cluster.wait_for(lambda: cluster.get("apps/v1", "StatefulSet", ns, "sc-decode"), "decode StatefulSet")
    cluster.kubectl("scale", "sr/sc-decode", "-n", ns, "--replicas=3")
    cluster.wait_for(lambda: cluster.get("apps/v1", "StatefulSet", ns, "sc-decode")["spec"]["replicas"] == 3,
                     "StatefulSet scaled to 3")

    router_generation = cluster.get("apps/v1", "Deployment", ns, "sc-router")["metadata"]["generation"]
    cluster.wait_for(lambda: json.loads(cluster.get("v1", "ConfigMap", ns, "sc-peers")["data"]["peers.json"])[
        "roles"]["decode"]["replicas"] == 3, "peers list 3 decode pods")
    # The router finds the new pods through the Endpoints: its Deployment is not touched.
    assert cluster.get("apps/v1", "Deployment", ns, "sc-router")["metadata"]["generation"] == router_generation
    peers = json.loads(cluster.get("v1", "ConfigMap", ns, "sc-peers")["data"]["peers.json"])
    assert peers["roles"]["decode"]["replicas"] == 3
    # The scale subresource reports the selector an autoscaler needs.
    scale = cluster.kubectl("get", "--raw", f"/apis/splitserve.io/v1alpha1/namespaces/{ns}/servingroles/"
                            "sc-decode/scale").stdout
    assert json.loads(scale)["spec"]["replicas"] == 3
    # Several resyncs later the group has not fought the scale.
    cluster.wait_for(lambda: cluster.condition(ns, "sc", "Ready").get("status") == "True", "Ready",
                     ready_pods_in=ns)
    assert cluster.get(GROUP_API_VERSION, "ServingRole", ns, "sc-decode")["spec"]["replicas"] == 3
    assert cluster.get("apps/v1", "StatefulSet", ns, "sc-decode")["spec"]["replicas"] == 3
    # Changing the group's own value is pushed to the role.
    cluster.kubectl("patch", "sg/sc", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"roles":{"decode":{"replicas":2}}}}')
    cluster.wait_for(lambda: cluster.get("apps/v1", "StatefulSet", ns, "sc-decode")["spec"]["replicas"] == 2,
                     "StatefulSet back to the group's 2")


def test_an_edit_rolls_out_keeping_prefill_and_decode_within_the_skew(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-roll")
    cluster.apply_yaml(ns, small_group("r", prefill=2, decode=4, skew=25))
    cluster.wait_for(lambda: cluster.condition(ns, "r", "Ready").get("status") == "True", "Ready",
                     ready_pods_in=ns, timeout=90)
    old = cluster.group(ns, "r")["status"]["revision"]
    cluster.kubectl("patch", "sg/r", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"roles":{"decode":{"engineArgs":["--max-running-requests=8"]}}}}')
    new = cluster.wait_for(lambda: (cluster.group(ns, "r")["status"].get("revision") != old
                                    and cluster.group(ns, "r")["status"]["revision"]), "a new revision")
    worst = 0.0
    seen_partial = False

    def pods_on(role: str) -> tuple[int, int]:
        pods = [p for p in cluster.children(ns, "r")["Pod"] if p["metadata"]["labels"].get(LABEL_ROLE) == role
                and not p["metadata"].get("deletionTimestamp")]
        return sum(1 for p in pods if p["metadata"]["labels"].get(LABEL_REVISION) == new), len(pods)

    def rolled() -> bool:
        nonlocal worst, seen_partial
        (p_new, _), (d_new, _) = pods_on("prefill"), pods_on("decode")
        skew = abs(p_new / 2 - d_new / 4)
        worst = max(worst, skew)
        seen_partial = seen_partial or (0 < p_new + d_new < 6)
        return p_new == 2 and d_new == 4 and cluster.condition(ns, "r", "Ready").get("status") == "True"

    cluster.wait_for(rolled, "every pod on the new revision", timeout=120, interval=0.2, ready_pods_in=ns)
    # 25% plus at most one pod of the smaller role (the least advanced role may always move).
    assert worst <= 0.25 + 0.5 + 1e-9, worst
    assert seen_partial, "the rollout was never observed half-way"
    sts = {r: cluster.get("apps/v1", "StatefulSet", ns, f"r-{r}") for r in ("prefill", "decode")}
    assert all(s["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0 for s in sts.values())
    command = sts["decode"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-1] == "--max-running-requests=8"
    assert cluster.condition(ns, "r", "Progressing")["reason"] == "Converged"


def test_deleting_the_group_deletes_every_child(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-del")
    cluster.apply_yaml(ns, small_group("d"))
    cluster.wait_for(lambda: len(cluster.children(ns, "d")["StatefulSet"]) == 2, "StatefulSets")
    cluster.kubectl("delete", "sg/d", "-n", ns, "--wait=false")

    def all_gone() -> bool:
        kids = cluster.children(ns, "d")
        return not any(kids[k] for k in kids)

    cluster.wait_for(all_gone, "garbage collection of every child", timeout=90)


def test_each_group_gets_network_policies_closing_its_engines_to_all_but_its_own_pods(cluster: Any,
                                                                                      operator: Any) -> None:
    ns = cluster.namespace("op-netpol")
    cluster.apply_yaml(ns, small_group("np", prefill=1, decode=2))
    cluster.apply_yaml(ns, small_group("other"))
    group = cluster.wait_for(lambda: cluster.group(ns, "np"), "the group")

    def policies() -> dict[str, dict[str, Any]] | None:
        found = {p["metadata"]["name"]: p for p in cluster.children(ns, "np")["NetworkPolicy"]}
        return found if sorted(found) == ["np-engines", "np-router"] else None

    found = cluster.wait_for(policies, "the group's two NetworkPolicies")
    for policy in found.values():
        (ref,) = policy["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "ServingGroup", "np", group["metadata"]["uid"], True)
    engines, router = found["np-engines"]["spec"], found["np-router"]["spec"]
    assert engines["podSelector"] == {
        "matchLabels": {"splitserve.io/group": "np"},
        "matchExpressions": [{"key": "splitserve.io/role", "operator": "NotIn", "values": ["router"]}]}
    assert engines["policyTypes"] == ["Ingress"]
    # From the group's own pods, on every port (no port list), and from nothing else.
    assert engines["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"splitserve.io/group": "np"}}}]}]
    assert router["podSelector"] == {"matchLabels": {"splitserve.io/group": "np", "splitserve.io/role": "router"}}
    assert router["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]

    # The API server's own label selection: the engine policy holds exactly the group's engine pods
    # (1 prefill + 2 decode), the router policy its router pod, the peers every pod of the group
    # and none of the other group's.
    def pods(selector: str) -> list[str]:
        items = cluster.kube.request("GET", collection_path("v1", "Pod", ns),
                                     query=[("labelSelector", selector)]).get("items", [])
        return sorted(p["metadata"]["name"] for p in items)

    everything = cluster.wait_for(lambda: (lambda names: names if len(names) == 7 else None)(pods("")),
                                  "the pods of both groups (4 and 3)")
    engine_pods = pods("splitserve.io/group=np,splitserve.io/role notin (router)")
    assert len(engine_pods) == 3 and all(n.startswith(("np-prefill-", "np-decode-")) for n in engine_pods)
    (router_pod,) = pods("splitserve.io/group=np,splitserve.io/role=router")
    assert router_pod.startswith("np-router-")
    assert pods("splitserve.io/group=np") == sorted([*engine_pods, router_pod])
    assert set(everything) - set(pods("splitserve.io/group=np")) == set(pods("splitserve.io/group=other"))

    # Level-based like every child: a deleted policy comes back, a hand edit is reverted.
    uid = found["np-engines"]["metadata"]["uid"]
    cluster.kubectl("delete", "networkpolicy", "np-engines", "-n", ns)
    again = cluster.wait_for(lambda: (lambda p: p if p and p["metadata"]["uid"] != uid else None)(
        cluster.get("networking.k8s.io/v1", "NetworkPolicy", ns, "np-engines")), "np-engines recreated")
    assert again["spec"]["ingress"] == engines["ingress"]
    cluster.kubectl("patch", "networkpolicy/np-router", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"ingress":[{}]}}')  # an edit that would admit every port
    cluster.wait_for(lambda: cluster.get("networking.k8s.io/v1", "NetworkPolicy", ns, "np-router")["spec"][
        "ingress"] == router["ingress"], "np-router's rule reverted")


def test_a_deleted_child_is_recreated_and_hand_edits_are_reverted(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-drift")
    cluster.apply_yaml(ns, small_group("dr"))
    cm = cluster.wait_for(lambda: cluster.get("v1", "ConfigMap", ns, "dr-peers"), "peers ConfigMap")
    secret = cluster.wait_for(lambda: cluster.get("v1", "Secret", ns, "dr-control"), "control Secret")
    cluster.kubectl("delete", "configmap", "dr-peers", "-n", ns)
    again = cluster.wait_for(lambda: cluster.get("v1", "ConfigMap", ns, "dr-peers"), "peers ConfigMap back")
    assert again["metadata"]["uid"] != cm["metadata"]["uid"]
    assert again["data"] == cm["data"]
    cluster.kubectl("patch", "svc/dr-router", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"ports":[{"name":"http","port":9999,"targetPort":"http"}]}}')
    cluster.wait_for(lambda: cluster.get("v1", "Service", ns, "dr-router")["spec"]["ports"][0]["port"] == 8000,
                     "router Service port reverted")
    # The shared key never changes.
    assert cluster.get("v1", "Secret", ns, "dr-control")["data"] == secret["data"]


def test_a_spec_the_schema_cannot_refuse_is_reported_degraded(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-bad")
    doc = yaml.safe_load(small_group("bad"))
    doc["spec"]["roles"]["decode"]["tensorParallelSize"] = 2
    doc["spec"]["roles"]["decode"]["resources"] = {"gpus": 1}
    cluster.apply_yaml(ns, yaml.safe_dump(doc))
    degraded = cluster.wait_for(lambda: cluster.condition(ns, "bad", "Degraded").get("status") == "True"
                                and cluster.condition(ns, "bad", "Degraded"), "Degraded=True")
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.roles.decode.resources.gpus is 1 but tensorParallelSize is 2" in degraded["message"]
    assert cluster.children(ns, "bad")["ServingRole"] == []
    # Fixing the spec recovers.
    cluster.kubectl("patch", "sg/bad", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"roles":{"decode":{"resources":{"gpus":2}}}}}')
    cluster.wait_for(lambda: cluster.condition(ns, "bad", "Degraded").get("status") == "False",
                     "Degraded=False after the fix")
    assert len(cluster.children(ns, "bad")["ServingRole"]) == 2


def test_a_servingrole_created_alone_gets_its_statefulset_and_scales(cluster: Any, operator: Any) -> None:
    ns = cluster.namespace("op-solo")
    cluster.apply_yaml(ns, """
apiVersion: splitserve.io/v1alpha1
kind: ServingRole
metadata:
  name: solo-decode
spec:
  group: solo
  role: decode
  replicas: 1
  model: {name: tiny, imagePath: /opt/models/tiny}
""")
    sts = cluster.wait_for(lambda: cluster.get("apps/v1", "StatefulSet", ns, "solo-decode"), "StatefulSet")
    assert owner_names(sts) == [("ServingRole", "solo-decode")]
    assert cluster.get("v1", "Service", ns, "solo-decode")["spec"]["clusterIP"] == "None"
    cluster.kubectl("scale", "sr/solo-decode", "-n", ns, "--replicas=2")
    cluster.wait_for(lambda: cluster.get(GROUP_API_VERSION, "ServingRole", ns, "solo-decode").get(
        "status", {}).get("readyReplicas") == 2, "2 ready replicas", ready_pods_in=ns)
    table = cluster.kubectl("get", "sr", "solo-decode", "-n", ns).stdout.splitlines()
    assert table[1].split()[:5] == ["solo-decode", "solo", "decode", "2", "2"]


def test_an_operator_restarted_mid_way_converges_without_duplicates(cluster: Any) -> None:
    ns = cluster.namespace("restart")
    first = cluster.start_operator([ns])
    cluster.apply_yaml(ns, cluster.example("2p4d-tp2"))
    # Kill it as soon as it has started writing children: a crash half-way through.
    cluster.wait_for(lambda: cluster.children(ns, "llama-2p4d")["ServingRole"], "the first child", interval=0.05)
    first.kill()
    second = cluster.start_operator([ns])

    def converged() -> dict[str, list[dict[str, Any]]] | None:
        kids = cluster.children(ns, "llama-2p4d")
        counts = {k: len(v) for k, v in kids.items() if k != "Pod"}
        want = {"ServingRole": 2, "StatefulSet": 2, "Service": 5, "Deployment": 1, "ConfigMap": 1, "Secret": 1,
                "NetworkPolicy": 2}
        return kids if counts == want else None

    kids = cluster.wait_for(converged, "exactly one of each child", timeout=60)
    cluster.wait_for(lambda: cluster.condition(ns, "llama-2p4d", "Ready").get("status") == "True", "Ready",
                     ready_pods_in=ns, timeout=90)

    def versions() -> dict[tuple[str, str], tuple[str, str]]:
        return {(k, o["metadata"]["name"]): (o["metadata"]["uid"], o["metadata"]["resourceVersion"])
                for k, objs in cluster.children(ns, "llama-2p4d").items() if k != "Pod" for o in objs}

    # Converged means quiet: nothing written for two resync periods.
    before = versions()
    for _ in range(30):
        time.sleep(2 * 3)
        if versions() == before:
            break
        before = versions()
    else:
        pytest.fail("the operator never stopped writing")
    assert {(k, o["metadata"]["name"]) for k, objs in kids.items() if k != "Pod" for o in objs} == set(before)
    group_status = cluster.group(ns, "llama-2p4d")["status"]
    # A clean restart changes nothing: no child is written again (same resourceVersions).
    second.stop()
    third = cluster.start_operator([ns])
    time.sleep(2 * 3 + 2)  # two resync periods
    assert third.proc.poll() is None
    assert versions() == before
    assert cluster.group(ns, "llama-2p4d")["status"] == group_status
    third.stop()
