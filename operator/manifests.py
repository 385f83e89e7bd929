"""Plain-YAML install manifests (manifests/rbac.yaml, manifests/operator.yaml), rendered from
the Helm chart so that the chart stays their one source.

``python -P -m splitserve.operator.manifests --helm PATH --write`` regenerates them (with the
chart's default values: cluster-wide, namespace splitserve-system); a test fails on drift.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import subprocess
import sys
from typing import Any

import yaml

log = logging.getLogger(__name__)

NAMESPACE = "splitserve-system"
RELEASE = "splitserve"
# Labels that describe a Helm release; plain manifests are not one.
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def render_chart(helm: str, chart: pathlib.Path) -> list[dict[str, Any]]:
    """The chart's objects (CRDs excluded) as ``helm template`` renders them."""
    out = subprocess.run([helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    for obj in objects:
        labels = obj["metadata"].get("labels") or {}
        for key in HELM_ONLY_LABELS:
            labels.pop(key, None)
    return objects


def plain_manifests(helm: str, chart: pathlib.Path) -> dict[str, str]:
    """File name (under manifests/) to YAML text: rbac.yaml and operator.yaml."""
    objects = render_chart(helm, chart)
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "splitserve"}}}
    rbac = [o for o in objects if o["kind"] in RBAC_KINDS]
    rest = [o for o in objects if o["kind"] not in RBAC_KINDS]
    header = ("# Generated from charts/splitserve by `python -P -m splitserve.operator.manifests --write`;"
              " do not edit.\n")

    def dump(objs: list[dict[str, Any]]) -> str:
        return header + "---\n".join(yaml.safe_dump(o, sort_keys=False, width=100) for o in objs)

    return {"rbac.yaml": dump([namespace, *rbac]), "operator.yaml": dump(rest)}


def main(argv: list[str] | None = None) -> int:
    """``--write`` regenerates manifests/{rbac,operator}.yaml; ``--check`` exits 1 on drift."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog="python -P -m splitserve.operator.manifests")
    parser.add_argument("--helm", default="helm", help="helm binary")
    parser.add_argument("--repo", type=pathlib.Path, default=repo)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = []
    for name, text in plain_manifests(args.helm, args.repo / "charts" / "splitserve").items():
        path = args.repo / "manifests" / name
        if args.write:
            path.write_text(text)
            log.info("wrote %s", path)
        elif not path.exists() or path.read_text() != text:
            log.error("stale: %s", path)
            stale.append(path)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
