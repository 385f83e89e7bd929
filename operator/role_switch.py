"""Runtime role switches of a planned group's engines: which pod serves which role, and how the planner's
replica targets become StatefulSet sizes once some pods serve another role than their own.

A switched pod stays where it is: in its StatefulSet (its home role's), under its role label (the StatefulSet and
the role Services select on it, and a changed selector label would orphan it), with the annotation
``SERVING_ROLE`` naming the role it serves now. The operator asks the engine to switch (``POST /internal/role``:
it drains, swaps its behaviours, keeps its weights) and annotates the pod once it has; the router follows the
role the engine reports on ``/health``. Switching back home removes the annotation.

Counting follows the pods: a role's replicas are its StatefulSet's, less its pods serving the other role, plus
the other StatefulSet's pods serving it. A StatefulSet only ever removes its highest ordinal, so a role shrinks
by the top pod of whichever StatefulSet has one serving that role at its top (its own first); a switch takes the
donor role's highest ordinals, so that a later scale-down of their StatefulSet removes them first.

Pure: no Kubernetes calls here (operator/planner_loop.py makes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.operator.names import LABEL_ROLE
from splitserve.operator.status import pod_is_ready
from splitserve.planner.policy import ROLES, other

SERVING_ROLE = "splitserve.io/serving-role"  # pod annotation: the role a switched engine serves now

Pod = Mapping[str, Any]


def home_role(pod: Pod) -> str | None:
    """The role of the pod's StatefulSet (its role label)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE)


def serving_role(pod: Pod) -> str | None:
    """The role the pod's engine serves: its annotation after a switch, else its home role."""
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(SERVING_ROLE) or home_role(pod)


def ordinal(pod: Pod) -> int:
    """A StatefulSet pod's ordinal, from its name (``<group>-<role>-<n>``)."""
    tail = pod["metadata"]["name"].rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def with_serving_role(pod: Pod, role: str) -> dict[str, Any]:
    """The pod with its serving-role annotation set to ``role`` (removed when ``role`` is its home)."""
    meta = dict(pod["metadata"])
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != SERVING_ROLE}
    if role != home_role(pod):
        annotations[SERVING_ROLE] = role
    meta["annotations"] = annotations
    return {**pod, "metadata": meta}


def engine_pods(pods: Sequence[Pod], replicas: Mapping[str, int]) -> list[Pod]:
    """The prefill and decode pods that stay: not being deleted, within their StatefulSet's size."""
    out = []
    for pod in pods:
        home = home_role(pod)
        if home in ROLES and not pod["metadata"].get("deletionTimestamp") and 0 <= ordinal(pod) < replicas[home]:
            out.append(pod)
    return out


@dataclass(frozen=True)
class Serving:
    """Each role's replicas as the engines serve them: counted (serving or on their way) and ready."""

    replicas: dict[str, int]
    ready: dict[str, int]
    switched: dict[str, str]  # pod name -> the role it serves away from home


def serving(pods: Sequence[Pod], replicas: Mapping[str, int]) -> Serving:
    """The roles' replicas from the StatefulSets' sizes (``replicas``) and the pods' serving roles."""
    counted = {r: int(replicas[r]) for r in ROLES}
    ready = dict.fromkeys(ROLES, 0)
    switched = {}
    for pod in engine_pods(pods, replicas):
        home, serves = home_role(pod), serving_role(pod)
        if serves not in ROLES:
            continue
        if serves != home:
            counted[home] -= 1
            counted[serves] += 1
            switched[pod["metadata"]["name"]] = serves
        if pod_is_ready(pod):
            ready[serves] += 1
    return Serving(counted, ready, switched)


def switch_donors(pods: Sequence[Pod], replicas: Mapping[str, int], from_role: str, to_role: str,
                  count: int) -> list[Pod]:
    """Up to ``count`` ready pods serving ``from_role`` to switch to ``to_role``: pods going home first (their
    StatefulSet is ``to_role``'s), then the highest ordinals (the first a scale-down of theirs would remove)."""
    candidates = [p for p in engine_pods(pods, replicas)
                  if serving_role(p) == from_role and pod_is_ready(p) and (p.get("status") or {}).get("podIP")]
    candidates.sort(key=lambda p: (home_role(p) != to_role, -ordinal(p), p["metadata"]["name"]))
    return candidates[:max(0, count)]


def statefulset_sizes(pods: Sequence[Pod], replicas: Mapping[str, int], targets: Mapping[str, int]
                      ) -> tuple[dict[str, int], dict[str, int]]:
    """The StatefulSet sizes that bring each role's serving replicas to ``targets``, and per role how many it
    could not shed this time (none of its pods at the top of a StatefulSet: a later interval tries again).

    A role that grows grows its own StatefulSet (new pods serve their home role). A role that shrinks drops,
    one at a time, the other StatefulSet's top pod if that one serves it (a pod switched to it: the switches
    go first, so pods come back to serving their home roles), else its own StatefulSet's top pod if that one
    serves it."""
    sizes = {r: int(replicas[r]) for r in ROLES}
    by_ordinal = {(home_role(p), ordinal(p)): serving_role(p) for p in engine_pods(pods, replicas)}

    def top_serves(home: str) -> str | None:
        if sizes[home] <= 0:
            return None
        return by_ordinal.get((home, sizes[home] - 1), home)  # an ordinal not created yet will serve its home

    now = serving(pods, replicas).replicas
    short = dict.fromkeys(ROLES, 0)
    for role in ROLES:
        diff = int(targets[role]) - now[role]
        if diff > 0:
            sizes[role] += diff
        for _ in range(-diff):
            home = next((h for h in (other(role), role) if top_serves(h) == role), None)
            if home is None:
                short[role] += 1
                continue
            sizes[home] -= 1
    return sizes, short
