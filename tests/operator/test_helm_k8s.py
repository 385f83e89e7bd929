"""The Helm chart: lint, template, and install/upgrade/uninstall on the test API server, with an
operator running under the chart's ServiceAccount (so its least-privilege RBAC is exercised)."""

from __future__ import annotations

import base64
import pathlib
from typing import Any

import pytest
import yaml
from envtest import kubeconfig_document

from splitserve.operator.manifests import plain_manifests

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "splitserve"


def rendered(cluster: Any, *args: str) -> list[dict[str, Any]]:
    out = cluster.cp.helm("template", "splitserve", str(CHART), "--namespace", "splitserve-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_chart_lints_strictly_in_both_scopes(cluster: Any) -> None:
    for args in ([], ["--set", "watchNamespaces={a,b}"], ["--set", "rbac.create=false"]):
        result = cluster.cp.helm("lint", "--strict", str(CHART), *args)
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_template_is_cluster_wide_by_default_and_namespaced_on_request(cluster: Any) -> None:
    default = {(o["kind"], o["metadata"]["name"]) for o in rendered(cluster)}
    assert ("ClusterRole", "splitserve") in default
    assert ("Deployment", "splitserve") in default
    deployment = next(o for o in rendered(cluster) if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "args" not in container  # no --namespaces: every namespace
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    scoped = rendered(cluster, "--set", "watchNamespaces={team-a,team-b}")
    roles = sorted(o["metadata"]["namespace"] for o in scoped if o["kind"] == "Role")
    assert roles == ["team-a", "team-b"]
    assert ("ClusterRole", "splitserve") not in {(o["kind"], o["metadata"]["name"]) for o in scoped}
    container = next(o for o in scoped if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--namespaces", "team-a", "team-b"]
    # Least privilege: nothing may delete StatefulSets, Services or Secrets (the GC does).
    role = next(o for o in scoped if o["kind"] == "Role")
    for rule in role["rules"]:
        if set(rule["resources"]) & {"statefulsets", "services", "secrets", "deployments"}:
            assert "delete" not in rule["verbs"], rule


def test_plain_manifests_are_the_rendered_chart(cluster: Any) -> None:
    """Regenerate with: python -P -m splitserve.operator.manifests --helm <helm> --write"""
    for name, text in plain_manifests(cluster.cp.binary("helm"), CHART).items():
        assert (REPO / "manifests" / name).read_text() == text, f"manifests/{name} drifted from the chart"


def service_account_kubeconfig(cluster: Any, namespace: str, name: str, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig authenticating as a ServiceAccount (its token Secret, Kubernetes 1.20 style)."""
    def token() -> str | None:
        secrets = cluster.kube.list("v1", "Secret", namespace)
        for secret in secrets:
            annotations = secret["metadata"].get("annotations") or {}
            if (secret.get("type") == "kubernetes.io/service-account-token"
                    and annotations.get("kubernetes.io/service-account.name") == name and secret.get("data")):
                return base64.b64decode(secret["data"]["token"]).decode()
        return None

    value = cluster.wait_for(token, f"a token for ServiceAccount {namespace}/{name}")
    path.write_text(kubeconfig_document(cluster.cp.server, cluster.cp.certs.ca, {"token": value}, name="sa"))
    return path


def test_helm_install_upgrade_uninstall_with_the_operator_under_the_charts_rbac(cluster: Any) -> None:
    release_ns = cluster.namespace("helm")
    app_ns = cluster.namespace("helm-app")
    cluster.cp.helm("install", "splitserve", str(CHART), "--namespace", release_ns,
                    "--set", f"watchNamespaces={{{app_ns}}}", "--wait=false")
    deployment = cluster.get("apps/v1", "Deployment", release_ns, "splitserve")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "splitserve"
    can = cluster.kubectl("auth", "can-i", "create", "statefulsets", "-n", app_ns,
                          f"--as=system:serviceaccount:{release_ns}:splitserve", check=False).stdout.strip()
    assert can == "yes"
    cannot = cluster.kubectl("auth", "can-i", "create", "statefulsets", "-n", "default",
                             f"--as=system:serviceaccount:{release_ns}:splitserve", check=False).stdout.strip()
    assert cannot == "no"

    # No kubelet runs the chart's pod, so run the same operator here with the chart's identity.
    kubeconfig = service_account_kubeconfig(cluster, release_ns, "splitserve", cluster.workdir / "sa-kubeconfig")
    op = cluster.start_operator([app_ns], kubeconfig=kubeconfig)
    try:
        cluster.apply_yaml(app_ns, cluster.example("1p1d"))

        def children() -> bool:
            kids = cluster.children(app_ns, "qwen-1p1d")
            return len(kids["StatefulSet"]) == 2 and len(kids["Deployment"]) == 1

        cluster.wait_for(children, "children made by the operator under the chart's RBAC")
        cluster.wait_for(lambda: cluster.condition(app_ns, "qwen-1p1d", "Ready").get("status") == "True",
                         "Ready under the chart's RBAC", ready_pods_in=app_ns)
        assert "Forbidden" not in op.log_tail(200)
    finally:
        op.stop()

    cluster.cp.helm("upgrade", "splitserve", str(CHART), "--namespace", release_ns,
                    "--set", f"watchNamespaces={{{app_ns}}}", "--set", "resyncSeconds=30", "--wait=false")
    env = cluster.env_map(cluster.get("apps/v1", "Deployment", release_ns, "splitserve")["spec"]["template"]
                          ["spec"]["containers"][0])
    assert env["SPLITSERVE_RESYNC_SECONDS"] == "30"
    assert "splitserve" in cluster.cp.helm("list", "--namespace", release_ns, "-q").stdout.split()

    cluster.cp.helm("uninstall", "splitserve", "--namespace", release_ns)
    assert cluster.get("apps/v1", "Deployment", release_ns, "splitserve") is None
    roles = cluster.kubectl("get", "roles", "-n", app_ns, "-o", "name").stdout.split()
    assert "role.rbac.authorization.k8s.io/splitserve" not in roles
    # CRDs stay (Helm never deletes crds/), so the served groups survive an uninstall.
    assert cluster.kubectl("get", "crd", "servinggroups.splitserve.io", check=False).returncode == 0
    assert cluster.group(app_ns, "qwen-1p1d") is not None
