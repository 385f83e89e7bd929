"""Pure builders, validation, rollout and status: no cluster."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from splitserve.operator.group_builders import (
    build_control_secret,
    build_engine_network_policy,
    build_network_policies,
    build_peers_configmap,
    build_router_deployment,
    build_router_network_policy,
    build_router_role_binding,
    build_router_service_account,
    build_serving_role,
    group_roles,
    role_replicas,
    router_command,
)
from splitserve.operator.names import (
    ANNOTATION_GROUP_REPLICAS,
    LABEL_GROUP,
    LABEL_REVISION,
    LABEL_ROLE,
)
from splitserve.operator.role_builders import build_headless_service, build_statefulset
from splitserve.operator.rollout import RoleProgress, group_revision, role_revision, rollout_partitions
from splitserve.operator.status import condition, group_status, role_status, statefulset_settled
from splitserve.operator.validation import group_spec_problems, role_spec_problems

IMAGE = "example.com/splitserve:test"


def group(**spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "m", "pvc": {"claimName": "models", "subPath": "m"}, "mountPath": "/models"},
        "roles": {"prefill": {"replicas": 2, "tensorParallelSize": 2, "resources": {"gpus": 2}},
                  "decode": {"replicas": 4, "tensorParallelSize": 2, "resources": {"gpus": 2},
                             "engineArgs": ["--max-running-requests=64"]}},
        "transfer": {"protocol": "rdma", "devices": ["mlx5_0"], "bootstrapPort": 9000},
        "router": {"replicas": 1, "port": 8000},
        "rollout": {"maxSkewPercent": 25},
    }
    spec.update(spec_overrides)
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 3}, "spec": spec}


def role_body(group_body: dict[str, Any], role: str, partition: int = 0) -> dict[str, Any]:
    obj = build_serving_role(group_body, role, group_revision(group_body["spec"]), partition, None)
    obj["metadata"]["uid"] = f"uid-{role}"
    return obj


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_serving_role_is_named_after_group_and_role_and_owned_by_the_group() -> None:
    sr = role_body(group(), "prefill")
    assert sr["metadata"]["name"] == "g-prefill"
    assert sr["metadata"]["labels"][LABEL_GROUP] == "g"
    assert sr["metadata"]["labels"][LABEL_ROLE] == "prefill"
    (ref,) = sr["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("ServingGroup", "g", "uid-g", True)
    assert sr["spec"]["replicas"] == 2
    assert sr["spec"]["model"]["pvc"]["claimName"] == "models"
    assert sr["spec"]["peersConfigMap"] == "g-peers"
    assert sr["spec"]["controlSecret"] == "g-control"


def test_statefulset_runs_splitserve_serve_with_the_role_and_its_flags() -> None:
    sts = build_statefulset(role_body(group(), "prefill"), IMAGE)
    assert sts["metadata"]["name"] == "g-prefill"
    assert sts["spec"]["serviceName"] == "g-prefill"
    assert sts["spec"]["replicas"] == 2
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:4] == ["splitserve", "serve", "--role", "prefill"]
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[cmd.index("--bootstrap-port") + 1] == "9000"
    assert cmd[cmd.index("--model") + 1] == "/models"
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["image"] == IMAGE
    assert {"name": "bootstrap", "containerPort": 9000, "protocol": "TCP"} in container["ports"]
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "m"}


def test_decode_pods_get_no_bootstrap_flag_but_know_the_bootstrap_port() -> None:
    sts = build_statefulset(role_body(group(), "decode"), IMAGE)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--bootstrap-port" not in container["command"]
    assert container["command"][-1] == "--max-running-requests=64"
    env = env_of(container)
    assert env["SPLITSERVE_ROLE"] == "decode"
    assert env["SPLITSERVE_GROUP"] == "g"
    assert env["SPLITSERVE_BOOTSTRAP_PORT"] == "9000"
    assert env["SPLITSERVE_TRANSFER_PROTOCOL"] == "rdma"
    assert env["SPLITSERVE_TRANSFER_DEVICES"] == "mlx5_0"
    assert env["SPLITSERVE_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["SPLITSERVE_TRANSFER_CONTROL_KEY"] == {"secretKeyRef": {"name": "g-control", "key": "key"}}
    assert env["SPLITSERVE_PEERS_FILE"] == "/etc/splitserve/peers/peers.json"


def test_pods_carry_the_group_revision_and_the_selector_is_only_group_and_role() -> None:
    g = group()
    sts = build_statefulset(role_body(g, "decode"), IMAGE)
    assert sts["spec"]["selector"]["matchLabels"] == {LABEL_GROUP: "g", LABEL_ROLE: "decode"}
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL_REVISION] == group_revision(g["spec"])


def test_revision_ignores_replicas_router_and_rollout_but_not_engine_args() -> None:
    base = group()
    scaled = copy.deepcopy(base)
    scaled["spec"]["roles"]["decode"]["replicas"] = 9
    scaled["spec"]["router"]["replicas"] = 3
    scaled["spec"]["rollout"]["maxSkewPercent"] = 50
    assert group_revision(scaled["spec"]) == group_revision(base["spec"])
    edited = copy.deepcopy(base)
    edited["spec"]["roles"]["decode"]["engineArgs"] = ["--max-running-requests=32"]
    assert group_revision(edited["spec"]) != group_revision(base["spec"])


def test_standalone_role_revision_is_a_hash_of_its_spec_without_replicas() -> None:
    spec = {"group": "solo", "role": "decode", "replicas": 1, "model": {"name": "m", "imagePath": "/m"}}
    assert role_revision(spec) == role_revision({**spec, "replicas": 5, "updatePartition": 2})
    assert role_revision(spec) != role_revision({**spec, "engineArgs": ["--x=1"]})
    assert role_revision({**spec, "revision": "abc"}) == "abc"


def test_headless_service_publishes_not_ready_pods_with_named_ports() -> None:
    svc = build_headless_service(role_body(group(), "prefill"))
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "bootstrap", "embedding"]


def test_cpu_role_runs_on_cpu_without_gpu_resources() -> None:
    g = group(roles={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
              model={"name": "m", "imagePath": "/opt/m"}, transfer={"protocol": "tcp"})
    sts = build_statefulset(role_body(g, "decode"), IMAGE)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"][container["command"].index("--device") + 1] == "cpu"
    assert container["command"][container["command"].index("--model") + 1] == "/opt/m"
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert "securityContext" not in container
    assert all(v["name"] != "model" for v in sts["spec"]["template"]["spec"]["volumes"])


def test_drafter_uses_the_draft_model_and_decode_gets_speculative_env() -> None:
    g = group(roles={"prefill": {}, "decode": {"replicas": 2}, "drafter": {"replicas": 1}},
              speculative={"numDraftTokens": 5, "meshPort": 50070,
                           "draftModel": {"name": "small", "imagePath": "/opt/small"}})
    drafter = role_body(g, "drafter")
    assert drafter["spec"]["model"]["imagePath"] == "/opt/small"
    assert "draftModel" not in drafter["spec"]["speculative"]
    sts = build_statefulset(drafter, IMAGE)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"name": "draft-mesh", "containerPort": 50070, "protocol": "TCP"} in container["ports"]
    decode = build_statefulset(role_body(g, "decode"), IMAGE)
    env = env_of(decode["spec"]["template"]["spec"]["containers"][0])
    assert env["SPLITSERVE_NUM_DRAFT_TOKENS"] == "5"
    assert env["SPLITSERVE_DRAFT_MESH_PORT"] == "50070"
    prefill_env = env_of(build_statefulset(role_body(g, "prefill"), IMAGE)["spec"]["template"]["spec"]
                         ["containers"][0])
    assert "SPLITSERVE_NUM_DRAFT_TOKENS" not in prefill_env
    peers = json.loads(build_peers_configmap(g, {"prefill": 1, "decode": 2, "drafter": 1})["data"]["peers.json"])
    assert peers["roles"]["drafter"]["endpoints"][0]["meshPort"] == 50070
    assert peers["speculative"] == {"numDraftTokens": 5, "meshPort": 50070}


def test_group_replicas_do_not_override_a_role_scaled_on_its_own() -> None:
    g = group()
    existing = role_body(g, "decode")
    assert existing["metadata"]["annotations"][ANNOTATION_GROUP_REPLICAS] == "4"
    existing["spec"]["replicas"] = 7  # kubectl scale sr/g-decode --replicas=7
    assert role_replicas(g["spec"], "decode", existing) == 7
    g["spec"]["roles"]["decode"]["replicas"] = 5  # the group's own value changes: it wins
    assert role_replicas(g["spec"], "decode", existing) == 5
    assert role_replicas(g["spec"], "decode", None) == 5


def test_router_finds_its_engines_through_the_api_under_its_own_service_account() -> None:
    cmd = router_command("g", 8000)
    assert cmd == ["splitserve", "router", "--kube-group", "g", "--host", "0.0.0.0", "--port", "8000"]
    deployment = build_router_deployment(group(), IMAGE)
    assert deployment["metadata"]["name"] == "g-router"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == cmd
    assert pod["serviceAccountName"] == "g-router" and "automountServiceAccountToken" not in pod
    binding = build_router_role_binding(group(), "splitserve-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "splitserve-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "g-router", "namespace": "ns"}]
    assert build_router_service_account(group())["metadata"]["name"] == "g-router"


def test_scaling_a_role_leaves_the_router_deployment_as_it_is() -> None:
    before = build_router_deployment(group(), IMAGE)
    scaled = group()
    scaled["spec"]["roles"]["decode"]["replicas"] = 9
    assert build_router_deployment(scaled, IMAGE) == before


def test_router_command_parses_with_the_routers_own_flags() -> None:
    import argparse

    from splitserve.config_flags import add_config_flags, config_from_args
    from splitserve.router import RouterConfig

    cmd = router_command("g", 8100)
    assert cmd[:2] == ["splitserve", "router"]
    parser = argparse.ArgumentParser()
    add_config_flags(parser, RouterConfig, "SPLITSERVE_ROUTER")
    cfg = config_from_args(RouterConfig, parser.parse_args(cmd[2:]), "SPLITSERVE_ROUTER",
                           environ={"SPLITSERVE_ROUTER_KUBE_NAMESPACE": "ns"})
    assert (cfg.host, cfg.port, cfg.kube_group, cfg.kube_namespace) == ("0.0.0.0", 8100, "g", "ns")


def test_router_reads_client_api_keys_from_a_mounted_secret_only_when_the_spec_names_one() -> None:
    """A file the router rereads, so a rotated Secret takes effect without a restart; no Secret, an open router."""
    from splitserve.config_flags import env_name

    variable = env_name("SPLITSERVE_ROUTER", "api_key_file")
    plain = build_router_deployment(group(), IMAGE)["spec"]["template"]["spec"]
    assert variable not in env_of(plain["containers"][0])
    assert [v["name"] for v in plain["volumes"]] == ["peers"]
    spec = build_router_deployment(group(router={"replicas": 1, "port": 8000,
                                                 "apiKeySecret": {"name": "clients", "key": "keys.txt"}}),
                                   IMAGE)["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert env_of(container)[variable] == "/etc/splitserve/api-keys/keys"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"] == {"secretName": "clients", "items": [{"key": "keys.txt", "path": "keys"}]}
    assert {"name": "api-keys", "mountPath": "/etc/splitserve/api-keys", "readOnly": True} in container["volumeMounts"]
    default_key = build_router_deployment(group(router={"apiKeySecret": {"name": "clients"}}), IMAGE)
    (volume,) = [v for v in default_key["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
    assert volume["secret"]["items"] == [{"key": "api-keys", "path": "keys"}]


def test_router_gets_the_groups_key_from_its_secret_under_the_routers_own_variable() -> None:
    """The router signs bootstrap grants with the key the engines check them with."""
    import argparse

    from splitserve.config_flags import add_config_flags, config_from_args, env_name
    from splitserve.router import RouterConfig

    deployment = build_router_deployment(group(), IMAGE)
    env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    variable = env_name("SPLITSERVE_ROUTER", "transfer_control_key")
    assert env[variable] == {"secretKeyRef": {"name": "g-control", "key": "key"}}
    engine_env = env_of(build_statefulset(role_body(group(), "decode"), IMAGE)["spec"]["template"]["spec"][
        "containers"][0])
    assert engine_env["SPLITSERVE_TRANSFER_CONTROL_KEY"] == env[variable]  # the same Secret key
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # Readiness follows its backends (/ready); liveness (/health) never does.
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    parser = argparse.ArgumentParser()
    add_config_flags(parser, RouterConfig, "SPLITSERVE_ROUTER")
    cmd = router_command("g", 8000)
    cfg = config_from_args(RouterConfig, parser.parse_args(cmd[2:]), "SPLITSERVE_ROUTER", environ={variable: "k1"})
    assert cfg.transfer_control_key == "k1"


def test_peers_configmap_lists_every_pod_with_its_bootstrap_port() -> None:
    cm = build_peers_configmap(group(), {"prefill": 2, "decode": 4})
    peers = json.loads(cm["data"]["peers.json"])
    assert [e["host"] for e in peers["roles"]["prefill"]["endpoints"]] == [
        "g-prefill-0.g-prefill.ns.svc", "g-prefill-1.g-prefill.ns.svc"]
    assert peers["roles"]["prefill"]["endpoints"][0]["bootstrapPort"] == 9000
    assert len(peers["roles"]["decode"]["endpoints"]) == 4
    assert peers["router"] == "http://g-router.ns.svc:8000"


def test_encode_pods_run_the_encode_role_with_the_transfer_settings_and_the_embedding_port() -> None:
    g = group(roles={"prefill": {}, "decode": {}, "encode": {"replicas": 2}},
              transfer={"protocol": "tcp", "bootstrapPort": 9000, "embeddingPort": 9100})
    (container,) = build_statefulset(role_body(g, "encode"), IMAGE)["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:4] == ["splitserve", "serve", "--role", "encode"]
    assert cmd[cmd.index("--embedding-control-port") + 1] == "9100"
    assert "--bootstrap-port" not in cmd
    assert {"name": "embedding", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    env = env_of(container)
    assert env["SPLITSERVE_TRANSFER_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["SPLITSERVE_TRANSFER_CONTROL_KEY"] == {"secretKeyRef": {"name": "g-control", "key": "key"}}
    assert env["SPLITSERVE_TRANSFER_PROTOCOL"] == "tcp"
    (prefill,) = build_statefulset(role_body(g, "prefill"), IMAGE)["spec"]["template"]["spec"]["containers"]
    assert prefill["command"][prefill["command"].index("--embedding-control-port") + 1] == "9100"
    svc = build_headless_service(role_body(g, "encode"))
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "embedding"]
    peers = json.loads(build_peers_configmap(g, {"prefill": 1, "decode": 1, "encode": 2})["data"]["peers.json"])
    assert [e["embeddingPort"] for e in peers["roles"]["encode"]["endpoints"]] == [9100, 9100]


def test_control_secret_holds_the_key_base64_encoded() -> None:
    secret = build_control_secret(group(), b"\x01" * 32)
    assert base64.b64decode(secret["data"]["key"]) == b"\x01" * 32
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-g"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels, and In/NotIn/Exists/DoesNotExist expressions)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels_of_group(g: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The labels of every pod the group's children create, by role (router included)."""
    pods = {role: build_statefulset(role_body(g, role), IMAGE)["spec"]["template"]["metadata"]["labels"]
            for role in group_roles(g["spec"])}
    pods["router"] = build_router_deployment(g, IMAGE)["spec"]["template"]["metadata"]["labels"]
    return pods


def test_engine_network_policy_admits_only_the_groups_own_pods_on_every_port() -> None:
    g = group(roles={"prefill": {}, "decode": {}, "encode": {}, "drafter": {}},
              speculative={"draftModel": {"name": "d", "imagePath": "/d"}})
    policy = build_engine_network_policy(g)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert (policy["metadata"]["name"], policy["metadata"]["namespace"]) == ("g-engines", "ns")
    assert policy["metadata"]["labels"][LABEL_GROUP] == "g"
    (ref,) = policy["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("ServingGroup", "g", "uid-g", True)
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress stays open
    pods = pod_labels_of_group(g)
    # It closes every engine pod, and not the router's.
    assert {role for role, labels in pods.items() if selects(spec["podSelector"], labels)} == {
        "prefill", "decode", "encode", "drafter"}
    # One rule: from the group's pods (engines and router), with no port list (all ports: Mooncake's
    # handshake and data ports are picked at run time), and from nothing else (no ipBlock, no namespace).
    (rule,) = spec["ingress"]
    assert "ports" not in rule
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}
    assert all(selects(peer["podSelector"], labels) for labels in pods.values())
    other = pod_labels_of_group({**group(), "metadata": {"name": "h", "namespace": "ns", "uid": "uid-h"}})
    assert not any(selects(peer["podSelector"], labels) for labels in other.values())
    assert not any(selects(spec["podSelector"], labels) for labels in other.values())
    # A pod of the group whose role label is missing is closed too (NotIn, not In).
    assert selects(spec["podSelector"], {LABEL_GROUP: "g"})


def test_router_network_policy_admits_its_http_port_from_anywhere_and_nothing_else() -> None:
    g = group(router={"replicas": 2, "port": 8080})
    policy = build_router_network_policy(g)
    assert policy["metadata"]["name"] == "g-router"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-g"
    spec = policy["spec"]
    pods = pod_labels_of_group(g)
    assert [role for role, labels in pods.items() if selects(spec["podSelector"], labels)] == ["router"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]  # no "from": any source
    deployment = build_router_deployment(g, IMAGE)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 8080


def test_network_policies_follow_the_group_and_ignore_replicas() -> None:
    g = group()
    assert [p["metadata"]["name"] for p in build_network_policies(g)] == ["g-engines", "g-router"]
    scaled = group()
    scaled["spec"]["roles"]["decode"]["replicas"] = 9
    assert build_network_policies(scaled) == build_network_policies(g)


def test_group_roles_are_listed_in_reconcile_order() -> None:
    g = group(roles={"drafter": {}, "decode": {}, "prefill": {}, "encode": {}})
    assert group_roles(g["spec"]) == ["prefill", "decode", "encode", "drafter"]


@pytest.mark.parametrize(("spec_change", "expected"), [
    ({"roles": {"prefill": {"tensorParallelSize": 2, "resources": {"gpus": 1}}, "decode": {}}},
     "spec.roles.prefill.resources.gpus is 1 but tensorParallelSize is 2"),
    ({"roles": {"prefill": {"engineArgs": ["--tp-size=4"]}, "decode": {}}},
     "spec.roles.prefill.engineArgs[0] sets --tp-size"),
    ({"roles": {"prefill": {}, "decode": {"env": [{"name": "SPLITSERVE_ROLE", "value": "x"}]}}},
     "spec.roles.decode.env[0] sets SPLITSERVE_ROLE"),
    ({"roles": {"prefill": {}, "decode": {"env": [{"name": "A"}, {"name": "A"}]}}},
     "spec.roles.decode.env sets A more than once"),
    ({"roles": {"prefill": {}, "decode": {}, "drafter": {"replicas": 1}}},
     "spec.roles.drafter is set but spec.speculative is not"),
    ({"roles": {"prefill": {}, "decode": {}}, "speculative": {"numDraftTokens": 4}},
     "spec.speculative is set but spec.roles.drafter is not"),
    ({"roles": {"prefill": {"replicas": 0}, "decode": {}, "encode": {}}},
     "spec.roles.encode is set but prefill has 0 replicas"),
])
def test_cross_field_problems_are_reported_with_the_field(spec_change: dict[str, Any], expected: str) -> None:
    problems = group_spec_problems("g", group(**spec_change)["spec"])
    assert any(expected in p for p in problems), problems


def test_valid_group_has_no_problems_and_long_names_are_refused() -> None:
    assert group_spec_problems("g", group()["spec"]) == []
    assert "at most 40" in group_spec_problems("x" * 41, group()["spec"])[0]
    assert role_spec_problems("solo", {"role": "drafter", "group": "solo"}) == [
        "spec.role is drafter but spec.speculative is not set"]


def test_partitions_let_the_least_advanced_role_move_and_bound_the_other() -> None:
    start = rollout_partitions({"prefill": RoleProgress(2, 0), "decode": RoleProgress(4, 0)}, 25)
    # 25% of 4 decode pods = 1; prefill may take one pod although that is 50% of its pods.
    assert start == {"prefill": 1, "decode": 3}
    mid = rollout_partitions({"prefill": RoleProgress(2, 1), "decode": RoleProgress(4, 1)}, 25)
    # decode (25%) is behind prefill (50%): decode may go to 50%, prefill must wait.
    assert mid == {"prefill": 1, "decode": 2}
    done = rollout_partitions({"prefill": RoleProgress(2, 2), "decode": RoleProgress(4, 4)}, 25)
    assert done == {"prefill": 0, "decode": 0}


def test_partitions_never_leave_the_skew_and_always_finish() -> None:
    for skew in (0, 10, 25, 50, 100):
        for replicas in ((1, 1), (2, 4), (3, 8), (5, 2)):
            p, d = RoleProgress(replicas[0], 0), RoleProgress(replicas[1], 0)
            for _step in range(100):
                parts = rollout_partitions({"prefill": p, "decode": d}, skew)
                # The StatefulSet controller updates every pod above the partition.
                p = RoleProgress(p.replicas, p.replicas - parts["prefill"])
                d = RoleProgress(d.replicas, d.replicas - parts["decode"])
                one_pod = max(1 / p.replicas, 1 / d.replicas)
                assert abs(p.fraction - d.fraction) <= skew / 100 + one_pod + 1e-9
                if p.fraction == d.fraction == 1.0:
                    break
            else:
                pytest.fail(f"rollout stalled with skew {skew} and replicas {replicas}")


def test_roles_outside_the_skew_bound_roll_freely() -> None:
    parts = rollout_partitions({"prefill": RoleProgress(2, 0), "decode": RoleProgress(2, 0),
                                "encode": RoleProgress(3, 0)}, 0)
    assert parts["encode"] == 0


def test_condition_keeps_its_transition_time_while_status_holds() -> None:
    first = condition([], "Ready", False, "PodsNotReady", "", 1, "2024-01-01T00:00:00Z")
    same = condition([first], "Ready", False, "PodsNotReady", "x", 2, "2024-01-02T00:00:00Z")
    flipped = condition([same], "Ready", True, "AllReady", "", 2, "2024-01-03T00:00:00Z")
    assert same["lastTransitionTime"] == "2024-01-01T00:00:00Z"
    assert flipped["lastTransitionTime"] == "2024-01-03T00:00:00Z"


def ready_pod(revision: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"labels": {LABEL_REVISION: revision}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_role_status_counts_updated_ready_pods_and_exposes_the_selector() -> None:
    sr = role_body(group(), "decode")
    rev = sr["spec"]["revision"]
    sts = {"status": {"replicas": 4, "readyReplicas": 3}}
    pods = [ready_pod(rev), ready_pod(rev, ready=False), ready_pod("old"), ready_pod("old")]
    status = role_status(sr, sts, pods, "2024-01-01T00:00:00Z")
    assert (status["replicas"], status["readyReplicas"]) == (4, 3)
    assert (status["updatedReplicas"], status["updatedReadyReplicas"]) == (2, 1)
    assert status["selector"] == "splitserve.io/group=g,splitserve.io/role=decode"
    assert status["conditions"][0]["status"] == "False"


def test_a_settled_statefulset_stands_for_its_pods() -> None:
    sr = role_body(group(), "decode")
    sts = {"metadata": {"generation": 2}, "spec": {"replicas": 3},
           "status": {"observedGeneration": 2, "replicas": 3, "readyReplicas": 2, "updatedReplicas": 3,
                      "currentRevision": "r1", "updateRevision": "r1"}}
    assert statefulset_settled(sts)
    status = role_status(sr, sts, None, "2024-01-01T00:00:00Z")
    assert (status["readyReplicas"], status["updatedReplicas"], status["updatedReadyReplicas"]) == (2, 3, 2)
    # Not settled: status behind the spec, two revisions, or pods still being created.
    for change in ({"observedGeneration": 1}, {"updateRevision": "r2"}, {"updatedReplicas": 2}, {"replicas": 2}):
        assert not statefulset_settled({**sts, "status": {**sts["status"], **change}}), change
    assert not statefulset_settled(None)


def test_group_status_is_ready_only_when_every_role_and_the_router_are() -> None:
    g = group()
    rev = group_revision(g["spec"])
    roles = {r: {"spec": {"replicas": n}, "status": {"readyReplicas": n, "updatedReadyReplicas": n,
                                                       "revision": rev}}
             for r, n in (("prefill", 2), ("decode", 4))}
    router = {"status": {"readyReplicas": 1, "updatedReplicas": 1}}
    status = group_status(g, rev, roles, router, 1, "http://g-router.ns.svc:8000", [], None, "now")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "False"
    assert conditions["Degraded"]["status"] == "False"
    assert status["rolesReady"] == "prefill 2/2, decode 4/4"
    assert status["observedGeneration"] == 3
    roles["decode"]["status"]["revision"] = "old"
    rolling = group_status(g, rev, roles, router, 1, "", [], None, "now")
    conditions = {c["type"]: c for c in rolling["conditions"]}
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Progressing"]["reason"] == "RollingUpdate"
    invalid = group_status(g, rev, roles, router, 1, "", ["bad thing"], None, "now")
    degraded = next(c for c in invalid["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "InvalidSpec", "bad thing")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_pods_speak_the_engines_own_flags_and_env_vars(role: str) -> None:
    """The contract between operator and engine: the pod's command parses with `splitserve serve`'s
    parser, and every engine setting the operator passes by env var is a real config field."""
    import dataclasses

    from splitserve.api.serve_config import build_parser
    from splitserve.engine.config import EngineConfig
    from splitserve.transfer.config import TransferConfig

    sts = build_statefulset(role_body(group(), role), IMAGE)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["splitserve", "serve"]
    args = build_parser().parse_args(container["command"][2:])
    assert args.role == role and args.host == "0.0.0.0"
    fields = {f"SPLITSERVE_{f.name.upper()}" for cls in (EngineConfig, TransferConfig) for f in dataclasses.fields(cls)}
    engine_settings = {"SPLITSERVE_SERVED_MODEL_NAME", "SPLITSERVE_BOOTSTRAP_PORT", "SPLITSERVE_TRANSFER_PROTOCOL",
                       "SPLITSERVE_TRANSFER_DEVICES", "SPLITSERVE_TRANSFER_HOST", "SPLITSERVE_TRANSFER_CONTROL_KEY"}
    env = env_of(container)
    assert engine_settings <= set(env) | {"SPLITSERVE_SERVED_MODEL_NAME", "SPLITSERVE_TRANSFER_DEVICES"}
    assert engine_settings <= fields
    assert env["SPLITSERVE_TRANSFER_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
