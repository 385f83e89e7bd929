"""Revisions and coordinated rolling updates: pure functions, no API calls.

A group's revision is a hash of everything in its spec that reaches a pod. Pods carry it as
the label ``splitserve.io/revision``, so a change of it rolls every role. Each role is a
StatefulSet whose ``updateStrategy.rollingUpdate.partition`` the group sets so that the
fraction of prefill pods and of decode pods on the new revision stay within
``spec.rollout.maxSkewPercent`` of each other (a prefill and a decode pod exchange KV pages,
so their engines must stay compatible), while the least advanced role always moves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.operator.names import SKEW_BOUND_ROLES

# Group spec fields that reach no pod of a role: changing them never rolls the engines.
GROUP_FIELDS_OUTSIDE_PODS = ("router", "rollout", "slo")
# The fields of spec.kvStore that reach the engine pods (the rest are the master's own).
KV_STORE_ENGINE_FIELDS = ("enabled", "scope", "name", "port", "segmentMB")
# ServingRole spec fields that say how many pods or which pods roll, not what a pod is.
ROLE_FIELDS_OUTSIDE_PODS = ("replicas", "updatePartition", "revision")


def stable_hash(value: Any, length: int = 10) -> str:
    """A short hex digest of a JSON-able value, independent of key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def group_revision(spec: Mapping[str, Any]) -> str:
    """Revision of a ServingGroup's pod-affecting spec (replica counts excluded)."""
    pod_spec = {key: value for key, value in spec.items() if key not in GROUP_FIELDS_OUTSIDE_PODS}
    roles = {name: {k: v for k, v in (role or {}).items() if k != "replicas"}
             for name, role in (spec.get("roles") or {}).items()}
    pod_spec["roles"] = roles
    if "kvStore" in pod_spec:  # the engines see the store's address and their segment, not the master's pod
        pod_spec["kvStore"] = {k: v for k, v in (spec["kvStore"] or {}).items() if k in KV_STORE_ENGINE_FIELDS}
    return stable_hash(pod_spec)


def role_revision(spec: Mapping[str, Any]) -> str:
    """Revision of a ServingRole: ``spec.revision`` when the group set one, else a hash."""
    if spec.get("revision"):
        return str(spec["revision"])
    return stable_hash({k: v for k, v in spec.items() if k not in ROLE_FIELDS_OUTSIDE_PODS})


@dataclass(frozen=True)
class RoleProgress:
    """How far one role is through a rolling update."""

    replicas: int
    updated: int

    @property
    def fraction(self) -> float:
        """Fraction of the role's pods on the new revision (1.0 when it has none)."""
        if self.replicas <= 0:
            return 1.0
        return min(self.updated, self.replicas) / self.replicas


def rollout_partitions(progress: Mapping[str, RoleProgress], max_skew_percent: int) -> dict[str, int]:
    """StatefulSet partitions per role that keep prefill and decode within the skew.

    For the skew-bound roles, a role may have pods on the new revision up to the least
    advanced role's fraction plus ``max_skew_percent``; the least advanced role may always
    take one more pod, so a skew smaller than one pod's share never stalls the rollout.
    Other roles roll freely (partition 0). A partition never undoes pods already updated.
    """
    partitions = {name: 0 for name in progress}
    bound = {name: p for name, p in progress.items() if name in SKEW_BOUND_ROLES and p.replicas > 0}
    if len(bound) < 2:
        return partitions
    floor = min(p.fraction for p in bound.values())
    allowed = floor + max_skew_percent / 100.0
    for name, p in bound.items():
        target = math.floor(allowed * p.replicas + 1e-9)
        if p.fraction <= floor:
            target = max(target, p.updated + 1)
        target = max(min(target, p.replicas), min(p.updated, p.replicas))
        partitions[name] = p.replicas - target
    return partitions
