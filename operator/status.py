"""Pure functions from observed children to the status of a ServingRole and a ServingGroup."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from splitserve.operator.names import LABEL_REVISION
from splitserve.operator.role_builders import selector_string
from splitserve.operator.rollout import role_revision

Body = Mapping[str, Any]


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes timestamps."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_is_ready(pod: Body) -> bool:
    """Whether a pod's Ready condition is True (and it is not being deleted)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def condition(previous: Iterable[Mapping[str, Any]], type_: str, status: bool, reason: str, message: str,
              generation: int, now: str) -> dict[str, Any]:
    """A condition; its lastTransitionTime moves only when its status changes."""
    text = "True" if status else "False"
    last = next((c for c in previous if c.get("type") == type_), None)
    since = last.get("lastTransitionTime") if last and last.get("status") == text else None
    return {"type": type_, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": since or now, "observedGeneration": generation}


def statefulset_settled(statefulset: Body | None) -> bool:
    """Whether a StatefulSet's status covers its current spec and every pod is on one revision, its
    update revision: its own counts then say how many pods are updated and ready, no pod list needed."""
    if not statefulset:
        return False
    status, spec = statefulset.get("status") or {}, statefulset.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    return (status.get("observedGeneration") == statefulset.get("metadata", {}).get("generation")
            and bool(status.get("updateRevision")) and status.get("updateRevision") == status.get("currentRevision")
            and int(status.get("replicas", 0) or 0) == replicas
            and int(status.get("updatedReplicas", 0) or 0) == replicas)


def role_status(role_body: Body, statefulset: Body | None, pods: Iterable[Body] | None, now: str) -> dict[str, Any]:
    """Status of a ServingRole from its StatefulSet and pods (``pods`` None: the StatefulSet is
    settled, see :func:`statefulset_settled`, and its counts stand for them)."""
    spec, meta = role_body["spec"], role_body["metadata"]
    revision = role_revision(spec)
    sts_status = (statefulset or {}).get("status") or {}
    desired = int(spec.get("replicas", 1))
    ready = int(sts_status.get("readyReplicas", 0) or 0)
    if pods is None:
        updated_count, updated_ready = int(sts_status.get("updatedReplicas", 0) or 0), ready
    else:
        current = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
        updated = [p for p in current if (p["metadata"].get("labels") or {}).get(LABEL_REVISION) == revision]
        updated_count, updated_ready = len(updated), sum(1 for p in updated if pod_is_ready(p))
    generation = int(meta.get("generation", 0) or 0)
    previous = (role_body.get("status") or {}).get("conditions") or []
    is_ready = ready >= desired and updated_ready >= min(desired, max(0, desired - int(
        spec.get("updatePartition", 0) or 0)))
    message = f"{ready}/{desired} ready, {updated_ready} on revision {revision}"
    return {
        "observedGeneration": generation,
        "replicas": int(sts_status.get("replicas", 0) or 0),
        "readyReplicas": ready,
        "updatedReplicas": updated_count,
        "updatedReadyReplicas": updated_ready,
        "revision": revision,
        "selector": selector_string(spec["group"], spec["role"]),
        "conditions": [condition(previous, "Ready", is_ready, "AllReady" if is_ready else "PodsNotReady",
                                 message, generation, now)],
    }


def group_status(group_body: Body, revision: str, roles: Mapping[str, Body | None],
                 router: Body | None, router_desired: int, endpoint: str, problems: list[str],
                 error: str | None, now: str) -> dict[str, Any]:
    """Status of a ServingGroup from its ServingRoles and router Deployment.

    ``problems`` are spec problems (Degraded/InvalidSpec); ``error`` is a failure to apply
    the children (Degraded/ApplyFailed).
    """
    meta = group_body["metadata"]
    generation = int(meta.get("generation", 0) or 0)
    previous_status = group_body.get("status") or {}
    previous = previous_status.get("conditions") or []
    counts: dict[str, dict[str, int]] = {}
    for name, role in roles.items():
        spec = (role or {}).get("spec") or {}
        status = (role or {}).get("status") or {}
        fresh = status.get("revision") == revision
        counts[name] = {
            "desired": int(spec.get("replicas", 0) or 0),
            "ready": int(status.get("readyReplicas", 0) or 0),
            "updated": int(status.get("updatedReadyReplicas", 0) or 0) if fresh else 0,
        }
    router_status = (router or {}).get("status") or {}
    router_counts = {"desired": router_desired,
                     "ready": int(router_status.get("readyReplicas", 0) or 0),
                     "updated": int(router_status.get("updatedReplicas", 0) or 0)}
    rolling = [n for n, c in counts.items() if c["updated"] < c["desired"]]
    waiting = [n for n, c in counts.items() if c["ready"] < c["desired"]]
    if router_counts["ready"] < router_desired:
        waiting.append("router")
    summary = ", ".join(f"{n} {c['ready']}/{c['desired']}" for n, c in counts.items())

    if problems:
        ready = (False, "InvalidSpec", "the spec cannot be reconciled; see Degraded")
        progressing = (False, "InvalidSpec", "reconciliation is stopped until the spec is fixed")
        degraded = (True, "InvalidSpec", "; ".join(problems))
    elif error:
        ready = (False, "ApplyFailed", "children could not be applied; see Degraded")
        progressing = (True, "Retrying", "retrying the children")
        degraded = (True, "ApplyFailed", error)
    else:
        if rolling:
            progressing = (True, "RollingUpdate", f"rolling revision {revision}: " + ", ".join(
                f"{n} {counts[n]['updated']}/{counts[n]['desired']}" for n in rolling))
        elif waiting:
            progressing = (True, "WaitingForPods", "not ready yet: " + ", ".join(waiting))
        else:
            progressing = (False, "Converged", f"every pod is ready on revision {revision}")
        is_ready = not rolling and not waiting
        ready = (is_ready, "AllReady" if is_ready else "PodsNotReady", summary or "no roles")
        prev_roles = previous_status.get("roles") or {}
        lost = [n for n, c in counts.items()
                if previous_status.get("revision") == revision and not rolling
                and c["ready"] < min(c["desired"], int((prev_roles.get(n) or {}).get("ready", 0)))]
        degraded = ((True, "PodsUnavailable", "ready pods lost: " + ", ".join(lost)) if lost
                    else (False, "AsExpected", "no problems"))

    conditions = [condition(previous, t, *c, generation=generation, now=now)
                  for t, c in (("Ready", ready), ("Progressing", progressing), ("Degraded", degraded))]
    return {
        "observedGeneration": generation,
        "revision": revision,
        "rolesReady": summary,
        "pd": f"{counts.get('prefill', {}).get('ready', 0)}:{counts.get('decode', {}).get('ready', 0)}",
        "desiredPD": f"{counts.get('prefill', {}).get('desired', 0)}:{counts.get('decode', {}).get('desired', 0)}",
        "routerEndpoint": endpoint,
        "roles": counts,
        "router": router_counts,
        "conditions": conditions,
    }
