"""The reconciler: thin, level-based reconcilers over the pure builders, fed by watch caches.

Everything ends in one of two functions, :meth:`Reconciler.reconcile_group` and
:meth:`Reconciler.reconcile_role`, which read the object and its children from the watch caches
(operator/informer.py), build the whole desired state from its spec, apply what differs and
write the status. They are idempotent, so they run when a group or role is first listed, when
its spec changes, on every change of a child (or, for a group, of a role's status) and on a
periodic resync; a restarted operator converges to the same objects. Deleting a group or a role
deletes its children through owner references (Kubernetes' garbage collector); no finalizer
is needed, and none is set (kopf's timers would set one on every object: the resync is ours).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from splitserve.operator.coalescing import Coalescer, Dispatcher
from splitserve.operator.config import OperatorConfig
from splitserve.operator.group_builders import (
    build_control_secret,
    build_network_policies,
    build_peers_configmap,
    build_router_deployment,
    build_router_role_binding,
    build_router_service,
    build_router_service_account,
    build_serving_role,
    group_roles,
    role_replicas,
    router_endpoint,
)
from splitserve.operator.informer import CachedKind, ObjectCache, Seen
from splitserve.operator.kube import Kube, KubeError, collection_path, controller_of, owned_by
from splitserve.operator.kv_store_builders import (
    KV_STORE_KINDS,
    build_kv_store,
    engine_kv_store,
    kv_store_spec,
    owner_references,
    shared,
    shared_port,
)
from splitserve.operator.names import (
    GROUP_API_VERSION,
    GROUP_KIND,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    ROLE_KIND,
    ROLE_NAMES,
    kv_store_name,
    role_object_name,
    router_name,
)
from splitserve.operator.planner_loop import PlannerLoop
from splitserve.operator.role_builders import build_role_children, selector_labels
from splitserve.operator.rollout import RoleProgress, group_revision, rollout_partitions
from splitserve.operator.status import group_status, now_rfc3339, role_status, statefulset_settled
from splitserve.operator.validation import InvalidSpec, group_spec_problems, role_spec_problems

log = logging.getLogger(__name__)

# A failed API call is retried after this many seconds (kopf.TemporaryError).
RETRY_DELAY = 5.0
CONTROL_KEY_BYTES = 32  # random bytes, written as hex: the key travels in an env var
# How many times a reconcile recomputes after a write conflict before retrying later.
CONFLICT_ATTEMPTS = 5


class Conflict(Exception):
    """An object changed between the read a desired state was computed from and the write."""
MANAGED = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# What the operator reads, kept in watch caches (operator/informer.py): every group and role (each
# reconciled once when first listed, as kopf's resume did) and the children it created.
CACHED_KINDS = [
    CachedKind(GROUP_API_VERSION, GROUP_KIND, notify_listed=True),
    CachedKind(GROUP_API_VERSION, ROLE_KIND, notify_listed=True),
    *(CachedKind(api_version, kind, MANAGED) for api_version, kind in (
        ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"),
        ("v1", "Secret"), ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("networking.k8s.io/v1", "NetworkPolicy"))),
]


def spec_changed(before: Seen | None, new: Mapping[str, Any]) -> bool:
    """Whether a group or role is new or its spec changed (a new generation), not only its status."""
    return before is None or before.generation != new["metadata"].get("generation")


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change the stored status (ignoring untouched keys)."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())


class Reconciler:
    """Reconciles ServingGroups and ServingRoles through a :class:`Kube` client."""

    def __init__(self, kube: Kube, config: OperatorConfig, cache_api: Any) -> None:
        """``cache_api``: an ApiClient of its own for the watch caches (their watches hold connections)."""
        self.kube = kube
        self.config = config
        # One reconcile per object at a time; triggers meanwhile fold into one more run.
        self._coalescer = Coalescer()
        self._dispatcher = Dispatcher(config.workers)
        self.cache = ObjectCache(cache_api, CACHED_KINDS, config.namespaces, self.on_change)
        self._stopped = threading.Event()
        self._resync_queue: list[tuple[str, str, str]] = []
        # The SLO planner of every group with spec.slo.enabled (operator/planner_loop.py).
        self.planner = PlannerLoop(kube, lambda kind, ns, name: self.cache.lookup(kind, ns, name)[1],
                                   lambda: self.cache.kinds[GROUP_KIND].names())

    def start(self) -> None:
        """Starts the watch caches (each group and role is reconciled once its kind is first listed),
        the periodic resync and the SLO planner's loop."""
        self.cache.start()
        threading.Thread(target=self._resync_forever, daemon=True, name="resync").start()
        self.planner.start()

    def stop(self) -> None:
        self._stopped.set()
        self.planner.stop()
        self.cache.stop()

    def _current(self, api_version: str, kind: str, namespace: str, name: str,
                 fresh: bool = False) -> dict[str, Any] | None:
        """An object as the watch cache has it or, when ``fresh`` or not listed yet, as the server has it."""
        if not fresh:
            known, obj = self.cache.lookup(kind, namespace, name)
            if known:
                return obj
        return self.kube.get(api_version, kind, namespace, name)

    def _apply(self, desired: dict[str, Any], observed: dict[str, Any] | None,
               shared: bool = False) -> tuple[str, dict[str, Any]]:
        """``shared``: an object of several groups (a namespace KV store), created by another meanwhile: the
        conflict makes the reconcile join it as it is instead of overwriting it."""
        result, current = self.kube.apply(desired, observed, looked_up=True, update_if_created_meanwhile=not shared)
        if result != "unchanged":
            self.cache.store(current)
        return result, current

    def _patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        # Into the cache at once: the next reconcile compares with this status, not the one before.
        self.cache.store(self.kube.patch_status(GROUP_API_VERSION, kind, namespace, name, status))

    # ServingGroup ----------------------------------------------------------------------------

    def reconcile_group(self, namespace: str, name: str) -> None:
        """Brings a ServingGroup's children and status to what its spec says."""
        self._coalescer.run((GROUP_KIND, namespace, name), lambda: self._reconcile_group_by_name(namespace, name))

    def _reconcile_group_by_name(self, namespace: str, name: str) -> None:
        for attempt in range(CONFLICT_ATTEMPTS):
            group = self._current(GROUP_API_VERSION, GROUP_KIND, namespace, name, fresh=attempt > 0)
            if group is None or group["metadata"].get("deletionTimestamp"):
                return
            try:
                # After a conflict the cache may still lag behind the change: read the server.
                self._reconcile_group(group, fresh=attempt > 0)
                return
            except Conflict:
                # A role changed (kubectl scale) between our read and our write: recompute.
                log.info("ServingGroup %s/%s: conflict on attempt %d, recomputing", namespace, name,
                         attempt + 1)
                time.sleep(0.05 * (attempt + 1))
        raise kopf.TemporaryError(f"ServingGroup {namespace}/{name}: conflicting writes", delay=RETRY_DELAY)

    def _reconcile_group(self, group: dict[str, Any], fresh: bool = False) -> None:
        meta, spec = group["metadata"], group["spec"]
        namespace, name = meta["namespace"], meta["name"]
        revision = group_revision(spec)
        existing = {role: self._current(GROUP_API_VERSION, ROLE_KIND, namespace, role_object_name(name, role), fresh)
                    for role in ROLE_NAMES}
        problems = group_spec_problems(name, spec)
        if problems:
            self._write_group_status(group, revision, existing, problems=problems)
            raise InvalidSpec(GROUP_KIND, f"{namespace}/{name}", problems)

        roles = group_roles(spec)
        replicas = {role: role_replicas(spec, role, existing[role]) for role in roles}
        progress = {}
        for role in roles:
            if existing[role] is None:
                # A new role has no pods on an older revision: nothing of it to roll.
                progress[role] = RoleProgress(replicas[role], replicas[role])
                continue
            status, role_spec = existing[role].get("status") or {}, existing[role].get("spec") or {}
            if status.get("revision") == revision:
                # Every pod not on an older revision: those on the new one, ready or not (the
                # StatefulSet controller itself waits for each updated pod to be ready before it
                # updates the next), and those not created yet, which will be. Counting only the
                # existing ones made a new group "roll" while its pods were being created,
                # rewriting partitions (and waking every watcher) at each pod.
                outdated = max(0, int(status.get("replicas", 0)) - int(status.get("updatedReplicas", 0)))
                updated = replicas[role] - outdated
            elif role_spec.get("revision") == revision:
                # The role has the new revision but has not reported on it yet: assume its
                # StatefulSet did what its partition says, so the partitions hold still.
                updated = replicas[role] - int(role_spec.get("updatePartition", 0))
            else:
                updated = 0  # the rollout of a new revision starts now
            progress[role] = RoleProgress(replicas[role], max(0, updated))
        max_skew = int((spec.get("rollout") or {}).get("maxSkewPercent", 25))
        partitions = rollout_partitions(progress, max_skew)
        kv = kv_store_spec(spec)
        store = kv_store_name(name, kv) if kv is not None else None
        # A namespace store as it is (its creator's settings, its other owners).
        existing_store = {kind: self._current(api_version, kind, namespace, store, fresh)
                          for api_version, kind in KV_STORE_KINDS} if kv is not None and shared(kv) else {}
        wired = engine_kv_store(group, shared_port(existing_store))

        desired = [
            # The policies first: no engine pod of the group runs without them.
            *build_network_policies(group),
            build_control_secret(group, secrets.token_hex(CONTROL_KEY_BYTES).encode()),
            build_peers_configmap(group, replicas),
            *build_kv_store(group, self.config.default_image, existing_store),
            *(build_serving_role(group, role, revision, partitions[role], existing[role], wired) for role in roles),
            build_router_service(group),
            build_router_service_account(group),
            build_router_role_binding(group, self.config.router_cluster_role),
            build_router_deployment(group, self.config.default_image),
        ]
        try:
            applied = {}
            observed = {(ROLE_KIND, role_object_name(name, r)): obj for r, obj in existing.items() if obj}
            read = {*observed, *((kind, store) for kind in existing_store)}
            observed.update({(kind, store): obj for kind, obj in existing_store.items() if obj})
            for obj in desired:
                key = (obj["kind"], obj["metadata"]["name"])
                if key in read:
                    result, current = self._apply(obj, observed.get(key), shared=obj["kind"] != ROLE_KIND)
                else:
                    result, current = self._apply(obj, self._current(
                        obj["apiVersion"], obj["kind"], namespace, key[1], fresh))
                applied[key] = current
                if result != "unchanged":
                    log.info("%s %s %s/%s", result, obj["kind"], namespace, obj["metadata"]["name"])
            for role in ROLE_NAMES:
                stale = existing[role]
                if role not in roles and stale is not None and owned_by(stale, meta["uid"]):
                    log.info("deleting ServingRole %s/%s: role %s left the group", namespace,
                             stale["metadata"]["name"], role)
                    self.kube.delete(GROUP_API_VERSION, ROLE_KIND, namespace, stale["metadata"]["name"])
            self._leave_kv_stores(group, store, fresh)
        except KubeError as exc:
            if exc.status == 409:
                raise Conflict(str(exc)) from exc
            self._write_group_status(group, revision, existing, error=str(exc))
            raise kopf.TemporaryError(f"applying the children of {namespace}/{name}: {exc}",
                                      delay=RETRY_DELAY) from exc

        current_roles = {role: applied[(ROLE_KIND, role_object_name(name, role))] for role in roles}
        self._write_group_status(group, revision, current_roles,
                                 router=applied[("Deployment", router_name(name))],
                                 kv_store={"name": store, "address": wired["address"]} if wired else {})

    def _leave_kv_stores(self, group: dict[str, Any], keep: str | None, fresh: bool) -> None:
        """Lets go of the KV stores the group used and no longer does: deletes its own, and takes its reference
        off a namespace store (deleting that when no other group holds it). Where it was is in its status."""
        meta = group["metadata"]
        namespace, uid = meta["namespace"], meta["uid"]
        used = ((group.get("status") or {}).get("kvStore") or {}).get("name")
        for name in {kv_store_name(meta["name"], None), used} - {keep, None}:
            for api_version, kind in reversed(KV_STORE_KINDS):
                obj = self._current(api_version, kind, namespace, name, fresh)
                if obj is None or not owned_by(obj, uid):
                    continue
                refs = owner_references(group, obj, keep=False)
                if refs:
                    body = {**obj, "metadata": {**obj["metadata"], "ownerReferences": refs}}
                    self.cache.store(self.kube.request(
                        "PUT", f"{collection_path(api_version, kind, namespace)}/{name}", body=body))
                    log.info("ServingGroup %s/%s left the KV store %s (%s)", namespace, meta["name"], name, kind)
                else:
                    log.info("deleting %s %s/%s: no group uses that KV store", kind, namespace, name)
                    self.kube.delete(api_version, kind, namespace, name)

    def _write_group_status(self, group: dict[str, Any], revision: str,
                            roles: Mapping[str, dict[str, Any] | None], *, problems: list[str] | None = None,
                            error: str | None = None, router: dict[str, Any] | None = None,
                            kv_store: dict[str, Any] | None = None) -> None:
        meta, spec = group["metadata"], group["spec"]
        shown = {role: roles.get(role) for role in group_roles(spec)}
        if router is None:
            router = self._current("apps/v1", "Deployment", meta["namespace"], router_name(meta["name"]))
        status = group_status(
            group, revision, shown, router, int((spec.get("router") or {}).get("replicas", 1)),
            router_endpoint(group), problems or [], error, now_rfc3339())
        if kv_store is not None and (kv_store or (group.get("status") or {}).get("kvStore")):
            status["kvStore"] = kv_store or None  # {}: no store (null clears it); None: left as it is
        if status_changed(group.get("status"), status):
            self._patch_status(GROUP_KIND, meta["namespace"], meta["name"], status)

    # ServingRole -----------------------------------------------------------------------------

    def reconcile_role(self, namespace: str, name: str) -> None:
        """Brings a ServingRole's StatefulSet, Service and status to what its spec says."""
        self._coalescer.run((ROLE_KIND, namespace, name), lambda: self._reconcile_role_by_name(namespace, name))

    def _reconcile_role_by_name(self, namespace: str, name: str) -> None:
        for attempt in range(CONFLICT_ATTEMPTS):
            role = self._current(GROUP_API_VERSION, ROLE_KIND, namespace, name, fresh=attempt > 0)
            if role is None or role["metadata"].get("deletionTimestamp"):
                return
            try:
                self._reconcile_role(role, fresh=attempt > 0)
                return
            except Conflict:
                log.info("ServingRole %s/%s: conflict on attempt %d, recomputing", namespace, name, attempt + 1)
                time.sleep(0.05 * (attempt + 1))
        raise kopf.TemporaryError(f"ServingRole {namespace}/{name}: conflicting writes", delay=RETRY_DELAY)

    def _reconcile_role(self, role: dict[str, Any], fresh: bool = False) -> None:
        meta, spec = role["metadata"], role["spec"]
        namespace, name = meta["namespace"], meta["name"]
        problems = role_spec_problems(name, spec)
        now = now_rfc3339()
        if problems:
            status = role_status(role, None, [], now)
            status["conditions"] = [{**status["conditions"][0], "reason": "InvalidSpec",
                                     "message": "; ".join(problems)}]
            if status_changed(role.get("status"), status):
                self._patch_status(ROLE_KIND, namespace, name, status)
            raise InvalidSpec(ROLE_KIND, f"{namespace}/{name}", problems)
        statefulset = None
        try:
            for obj in build_role_children(role, self.config.default_image):
                result, current = self._apply(obj, self._current(obj["apiVersion"], obj["kind"], namespace,
                                                                 obj["metadata"]["name"], fresh))
                if result != "unchanged":
                    log.info("%s %s %s/%s", result, obj["kind"], namespace, name)
                if obj["kind"] == "StatefulSet":
                    statefulset = current
            # Settled (one revision, status current): its counts are the pods'. Else the pods, from
            # the API server's watch cache (resourceVersion 0), not etcd: the StatefulSet
            # controller counted ready pods from that same cache, so it holds at least what the
            # StatefulSet's status says. (A list "not older than" the StatefulSet's version would
            # wait for a pod event: 1.20's cache of pods advances only with pod events.)
            pods = None if statefulset_settled(statefulset) else self.kube.list(
                "v1", "Pod", namespace, selector_labels(spec["group"], spec["role"]), from_cache=True)
        except KubeError as exc:
            if exc.status == 409:
                raise Conflict(str(exc)) from exc
            raise kopf.TemporaryError(f"applying the children of {namespace}/{name}: {exc}",
                                      delay=RETRY_DELAY) from exc
        status = role_status(role, statefulset, pods, now)
        if status_changed(role.get("status"), status):
            self._patch_status(ROLE_KIND, namespace, name, status)

    # Triggers ---------------------------------------------------------------------------------

    def on_change(self, body: Mapping[str, Any], before: Seen | None) -> None:
        """An object changed or went away, as a watch cache saw it. A group or role whose spec
        changed reconciles; so does the group or role controlling it (a role's status changes
        its group's): on a worker thread, never the watch's."""
        namespace = body["metadata"]["namespace"]
        if body["kind"] in (GROUP_KIND, ROLE_KIND) and spec_changed(before, body) and \
                not body["metadata"].get("deletionTimestamp"):
            self._trigger(namespace, {"kind": body["kind"], "name": body["metadata"]["name"]})
        owner = controller_of(body, (GROUP_KIND, ROLE_KIND))
        if owner is not None:
            self._trigger(namespace, owner)
            return
        for ref in body["metadata"].get("ownerReferences") or []:  # a namespace KV store: every group using it
            if ref.get("kind") == GROUP_KIND:
                self._trigger(namespace, ref)

    def _trigger(self, namespace: str, owner: Mapping[str, Any]) -> None:
        self._dispatcher.submit((owner["kind"], namespace, owner["name"]),
                                lambda: self._reconcile_owner(namespace, owner))

    def _reconcile_owner(self, namespace: str, owner: Mapping[str, Any]) -> None:
        try:
            if owner["kind"] == GROUP_KIND:
                self.reconcile_group(namespace, owner["name"])
            else:
                self.reconcile_role(namespace, owner["name"])
        except InvalidSpec as exc:
            log.info("%s %s/%s: %s", owner["kind"], namespace, owner["name"], exc)
        except kopf.TemporaryError as exc:
            # No other event may come to repair it: try again later, as kopf does for its handlers.
            log.info("%s %s/%s on a child's change: %s; again in %.0fs", owner["kind"], namespace,
                     owner["name"], exc, RETRY_DELAY)
            retry = threading.Timer(RETRY_DELAY, self._trigger, args=(namespace, owner))
            retry.daemon = True
            retry.start()

    def _resync_forever(self) -> None:
        """Reconciles every cached group and role once per ``--resync-seconds``, spread over the period
        (a safety net for drift no event reported). Not kopf's per-object timers: kopf puts a finalizer
        on every object that has one, a write per object and a deletion that waits for the operator."""
        while not self._stopped.wait(self.config.resync_seconds / max(1, len(self._resync_queue) or 1)):
            if not self._resync_queue:
                self._resync_queue = [(kind, ns, name) for kind in (GROUP_KIND, ROLE_KIND)
                                      for ns, name in self.cache.kinds[kind].names()]
                if not self._resync_queue:
                    continue
            kind, namespace, name = self._resync_queue.pop()
            self._trigger(namespace, {"kind": kind, "name": name})


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's credentials: $KUBECONFIG when set (``--kubeconfig`` sets it), else the pod's service account.

    In a pod this goes through the kubernetes client's in-cluster config, which reaches the API
    server at $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT as client-go does; kopf's own
    service-account login assumes https://kubernetes.default.svc (cluster DNS and port 443).
    """
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


def register_handlers(registry: kopf.OperatorRegistry) -> None:
    """Registers kopf's login in ``registry``. Nothing else: creations, changes and the first listing
    of groups and roles, every event of their children and the periodic resync come from the
    reconciler's watch caches (see :meth:`Reconciler.start`); kopf runs the process (login, signals,
    the liveness endpoint)."""
    kopf.on.login(id="login", registry=registry)(login)


def operator_settings() -> kopf.OperatorSettings:
    """kopf settings: standalone (no peering objects), warnings only as Kubernetes events."""
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.WARNING
    settings.peering.standalone = True
    return settings
