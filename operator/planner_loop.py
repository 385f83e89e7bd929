"""The SLO planner in the operator: one loop over every ServingGroup with ``spec.slo.enabled``.

Each group's interval (``spec.slo.intervalSeconds``) the loop:

1. lists the group's pods (the API server's watch cache) and scrapes ``/metrics`` of every running router and
   prefill and decode engine pod, in parallel, by pod IP (``planner_metrics.parse_metrics``);
2. turns this scrape and the last one into an interval (``planner_metrics.summarize``: percentiles from
   histogram bucket increases, rates from counter increases, gauges) and an ``Observation`` with the roles'
   replicas (their ``spec.replicas``) and ready pods (their status);
3. calls the group's ``SLOPlanner.decide`` (one planner per group, kept between intervals for its rate history
   and scale-down windows; a new one when ``spec.slo`` changes) on the replicas the engines serve (a pod switched
   to the other role counts there: operator/role_switch.py);
4. makes the role switches the decision prefers (``spec.slo.roleSwitch``): ``POST /internal/role`` to each donor
   pod, in parallel, and the pod's serving-role annotation once it has switched; a refused or failed switch is
   made up for by scaling in the same interval. Pods switched earlier whose engine reports its home role again
   (a restart) are asked once more;
5. writes each StatefulSet size that changes through its ServingRole's ``/scale`` subresource (the group never
   undoes that: it pushes its own ``spec.roles.<role>.replicas`` only when that value changes), and the planner's
   view into the group's ``status.planner`` (a merge patch: the reconciler's status keys are untouched);
6. sets the operator's own gauges (``splitserve_planner_*``), served on ``--metrics-port``.

The first interval of a group (and after an operator restart) only takes a baseline: counters have no previous
value to subtract yet. The loop is one thread ticking every second; not kopf timers, which would put a finalizer
on every group. A switch blocks the loop while the engine drains (seconds: ``SWITCH_SETTLE_S`` and its in-flight
requests), bounded by ``SWITCH_TIMEOUT_S``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.operator.group_builders import planner_enabled, router_port
from splitserve.operator.kube import Kube, KubeError, collection_path
from splitserve.operator.names import (
    CONTROL_KEY,
    DEFAULT_HTTP_PORT,
    GROUP_API_VERSION,
    GROUP_KIND,
    LABEL_GROUP,
    LABEL_ROLE,
    ROLE_KIND,
    ROUTER_ROLE,
    control_secret_name,
    role_object_name,
)
from splitserve.operator.planner_metrics import (
    PodScrape,
    Samples,
    observation,
    parse_metrics,
    pd,
    planner_config,
    planner_status,
    scale_body,
    scale_patches,
    summarize,
)
from splitserve.operator.role_switch import (
    SERVING_ROLE,
    home_role,
    serving,
    serving_role,
    statefulset_sizes,
    switch_donors,
    with_serving_role,
)
from splitserve.operator.status import now_rfc3339
from splitserve.planner.policy import ROLES, Decision, SLOPlanner
from splitserve.transfer.bootstrap_grant import KEY_HEADER

log = logging.getLogger(__name__)

TICK_S = 1.0
SCRAPE_TIMEOUT_S = 3.0
SCRAPED_ROLES = (*ROLES, ROUTER_ROLE)
SWITCH_SETTLE_S = 2.0  # an engine refuses new work this long before it swaps: every router's probe sees it drain
SWITCH_TIMEOUT_S = 120.0  # its in-flight requests finish within this, or the switch is called off
Fetch = Callable[[str, float], str]
Post = Callable[[str, dict[str, Any], dict[str, str], float], tuple[int, str]]


def fetch_text(url: str, timeout: float) -> str:
    """GET ``url``; the body as text."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def post_json(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> tuple[int, str]:
    """POST ``body`` as JSON; (status, body text), an HTTP error's too."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **headers},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class PlannerMetrics:
    """The operator's own metrics: what each group's planner saw and set."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["namespace", "group"]
        self.desired = Gauge("splitserve_planner_desired_replicas", "Replicas the planner set, per role",
                             [*labels, "role"], registry=r)
        self.current = Gauge("splitserve_planner_current_replicas", "Replicas when the planner last ran, per role",
                             [*labels, "role"], registry=r)
        self.ttft = Gauge("splitserve_planner_observed_ttft_seconds", "TTFT at the SLO percentile, last interval",
                          labels, registry=r)
        self.itl = Gauge("splitserve_planner_observed_itl_seconds", "ITL at the SLO percentile, last interval",
                         labels, registry=r)
        self.ttft_target = Gauge("splitserve_planner_ttft_target_seconds", "The group's TTFT target", labels,
                                 registry=r)
        self.itl_target = Gauge("splitserve_planner_itl_target_seconds", "The group's ITL target", labels,
                                registry=r)
        self.arrival_rate = Gauge("splitserve_planner_arrival_rate", "Requests per second, last interval",
                                  labels, registry=r)
        self.decisions = Counter("splitserve_planner_decisions", "Replica changes the planner made",
                                 [*labels, "role", "direction"], registry=r)
        self.scrape_failures = Counter("splitserve_planner_scrape_failures", "Pods whose /metrics failed",
                                       [*labels, "role"], registry=r)


@dataclass
class GroupPlanner:
    """One group's planner and what it keeps between intervals."""

    uid: str
    slo_key: str
    planner: SLOPlanner
    interval_s: float
    percentile: float
    last_scrape: dict[str, Samples] = field(default_factory=dict)
    last_time: float | None = None
    next_run: float = 0.0
    lengths: tuple[float, float] = (0.0, 0.0)  # the last mean prompt and output tokens seen


def slo_key(slo: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(slo, sort_keys=True).encode()).hexdigest()[:16]


def group_targets(pods: list[Mapping[str, Any]], spec: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(role, pod name, metrics URL) of each running router, prefill and decode pod with an IP; an engine under
    the role it serves (a switched pod's queue and batch are its new role's)."""
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        role = serving_role(pod) if home_role(pod) in ROLES else (meta.get("labels") or {}).get(LABEL_ROLE)
        if role not in SCRAPED_ROLES or meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        if status.get("phase") not in (None, "Running"):
            continue
        port = router_port(spec) if role == ROUTER_ROLE else DEFAULT_HTTP_PORT
        targets.append((role, meta["name"], pod_url(pod, port, "/metrics")))
    return targets


def pod_url(pod: Mapping[str, Any], port: int, path: str) -> str:
    """``path`` on the pod's IP (bracketed when it is IPv6)."""
    host = pod["status"]["podIP"]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}{path}"


class PlannerLoop:
    """Runs each planned group's planner once per its interval (see the module's docstring)."""

    def __init__(self, kube: Kube, lookup: Callable[[str, str, str], dict[str, Any] | None],
                 groups: Callable[[], list[tuple[str, str]]], metrics: PlannerMetrics | None = None,
                 fetch: Fetch = fetch_text, clock: Callable[[], float] = time.monotonic,
                 scrape_workers: int = 8, post: Post = post_json) -> None:
        """``lookup(kind, namespace, name)``: an object from the watch caches; ``groups()``: the (namespace,
        name) of every group held."""
        self.kube, self.lookup, self.groups = kube, lookup, groups
        self.metrics = metrics or PlannerMetrics()
        self.fetch, self.clock, self.post = fetch, clock, post
        self._planners: dict[tuple[str, str], GroupPlanner] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(scrape_workers, thread_name_prefix="scrape")
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="planner").start()

    def stop(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stopped.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # never let one bad interval end the loop
                log.exception("planner tick failed")

    def tick(self) -> None:
        """Runs every planned group whose interval is due; forgets groups no longer planned."""
        planned = set()
        for namespace, name in self.groups():
            group = self.lookup(GROUP_KIND, namespace, name)
            if group is None or group["metadata"].get("deletionTimestamp"):
                continue
            spec = group.get("spec") or {}
            if not planner_enabled(spec):
                continue
            planned.add((namespace, name))
            state = self._state(group)
            if self.clock() >= state.next_run:
                state.next_run = self.clock() + state.interval_s
                try:
                    self.run_group(group, state)
                except KubeError as exc:
                    log.warning("planner %s/%s: %s", namespace, name, exc)
        for key in set(self._planners) - planned:
            del self._planners[key]

    def _state(self, group: Mapping[str, Any]) -> GroupPlanner:
        meta, slo = group["metadata"], group["spec"]["slo"]
        key, uid, slo_hash = (meta["namespace"], meta["name"]), meta.get("uid", ""), slo_key(slo)
        state = self._planners.get(key)
        if state is None or state.uid != uid or state.slo_key != slo_hash:
            config = planner_config(slo)
            state = GroupPlanner(uid, slo_hash, SLOPlanner(config), config.interval_s, config.slo.percentile)
            self._planners[key] = state
        return state

    def scrape(self, targets: list[tuple[str, str, str]]) -> list[PodScrape]:
        """Every target's samples (None for a failed scrape), in parallel."""
        def one(target: tuple[str, str, str]) -> PodScrape:
            role, pod, url = target
            try:
                return PodScrape(role, pod, parse_metrics(self.fetch(url, SCRAPE_TIMEOUT_S)))
            except Exception as exc:  # unreachable, not serving yet, garbage: counted, not fatal
                log.debug("scraping %s (%s): %s", url, pod, exc)
                return PodScrape(role, pod, None)
        return list(self._pool.map(one, targets))

    def run_group(self, group: Mapping[str, Any], state: GroupPlanner) -> dict[str, Any] | None:
        """One interval of one group; returns the status written (None for a baseline or a skipped run)."""
        meta, spec = group["metadata"], group["spec"]
        namespace, name = meta["namespace"], meta["name"]
        labels = {"namespace": namespace, "group": name}
        roles = {role: self.lookup(ROLE_KIND, namespace, role_object_name(name, role)) for role in ROLES}
        if any(r is None for r in roles.values()):
            return None  # the reconciler has not created them yet
        replicas = {r: int((roles[r].get("spec") or {}).get("replicas", 0)) for r in ROLES}
        pods = self.kube.list("v1", "Pod", namespace, {LABEL_GROUP: name}, from_cache=True)
        scrapes = self.scrape(group_targets(pods, spec))
        for s in scrapes:
            if s.samples is None:
                self.metrics.scrape_failures.labels(namespace, name, s.role).inc()
        now = self.clock()
        previous, since = state.last_scrape, state.last_time
        state.last_scrape = {s.pod: s.samples for s in scrapes if s.samples is not None}
        state.last_time = now
        previous_status = (group.get("status") or {}).get("planner") or {}
        if since is None:
            self._write_status(namespace, name, {"lastRunTime": now_rfc3339(),
                                                 "message": "baseline scrape: deciding from the next interval"})
            return None
        interval = summarize(scrapes, previous, now - since, state.percentile)
        if not any(s.samples is not None for s in scrapes if s.role in ROLES):
            status = {"lastRunTime": now_rfc3339(),
                      "message": f"no engine metrics: scraped {interval.scraped}; replicas left as they are"}
            self._write_status(namespace, name, status)
            return status
        view = serving(pods, replicas)
        obs = observation(interval, now, view.replicas, view.ready, state.lengths)
        if interval.prompt_tokens and interval.output_tokens:
            state.lengths = (interval.prompt_tokens, interval.output_tokens)
        decision = state.planner.decide(obs)
        notes = self._reassert_switches(group, pods, view.switched)
        pods, switch_notes = self._switch(group, pods, replicas, decision)
        notes += switch_notes
        sizes, short = statefulset_sizes(pods, replicas, decision.replicas)
        notes += [f"{role}: {n} to shed, none at the top of a StatefulSet yet" for role, n in short.items() if n]
        for role, count in scale_patches(Decision(sizes, [], [], 0.0), replicas).items():
            try:
                self.kube.request("PATCH", f"{collection_path(GROUP_API_VERSION, ROLE_KIND, namespace)}/"
                                           f"{role_object_name(name, role)}/scale", body=scale_body(count),
                                  content_type="application/merge-patch+json")
                self.metrics.decisions.labels(namespace, name, role,
                                              "up" if count > replicas[role] else "down").inc()
                log.info("planner %s/%s: %s StatefulSet %d -> %d", namespace, name, role, replicas[role], count)
            except KubeError as exc:
                notes.append(f"scaling {role} to {count} failed: {exc}")
                log.warning("planner %s/%s: %s", namespace, name, notes[-1])
        message = "; ".join(notes)
        after = serving(pods, sizes)
        status = planner_status(interval, obs, decision, now_rfc3339(), previous_status, message)
        status["serving"] = pd(after.replicas)
        status["switched"] = ", ".join(f"{pod} serves {role}"
                                       for pod, role in sorted(after.switched.items())) or None
        self._write_status(namespace, name, status)
        slo = spec["slo"]
        for role in ROLES:
            self.metrics.desired.labels(namespace, name, role).set(decision.replicas[role])
            self.metrics.current.labels(namespace, name, role).set(obs.replicas[role])
        self.metrics.ttft_target.labels(**labels).set(float(slo["ttftSeconds"]))
        self.metrics.itl_target.labels(**labels).set(float(slo["itlSeconds"]))
        self.metrics.arrival_rate.labels(**labels).set(interval.arrival_rate)
        if interval.ttft_s is not None:
            self.metrics.ttft.labels(**labels).set(interval.ttft_s)
        if interval.itl_s is not None:
            self.metrics.itl.labels(**labels).set(interval.itl_s)
        return status

    # ---- role switches ----

    def _control_key(self, namespace: str, group: str) -> str:
        """The group's key, which /internal/* of its engines asks for ('' where the Secret is not there)."""
        secret = self.kube.get("v1", "Secret", namespace, control_secret_name(group)) or {}
        value = (secret.get("data") or {}).get(CONTROL_KEY)
        return base64.b64decode(value).decode() if value else ""

    def _ask_switches(self, group: Mapping[str, Any], asks: list[tuple[Mapping[str, Any], str]]
                      ) -> list[str | None]:
        """Asks each (pod, role)'s engine to serve the role, in parallel: per ask None once it does, else why not."""
        if not asks:
            return []
        key = self._control_key(group["metadata"]["namespace"], group["metadata"]["name"])
        return list(self._pool.map(lambda ask: self._ask_switch(ask[0], ask[1], key), asks))

    def _ask_switch(self, pod: Mapping[str, Any], role: str, key: str) -> str | None:
        url = pod_url(pod, DEFAULT_HTTP_PORT, "/internal/role")
        try:
            status, text = self.post(url, {"role": role, "settle_s": SWITCH_SETTLE_S, "timeout_s": SWITCH_TIMEOUT_S},
                                     {KEY_HEADER: key} if key else {}, SWITCH_TIMEOUT_S + 30)
        except Exception as exc:  # unreachable, timed out: this switch is off, the interval scales instead
            return f"{pod['metadata']['name']}: {exc}"
        if status != 200:
            return f"{pod['metadata']['name']} refused ({status}): {text[:200]}"
        return None

    def _annotate(self, pod: Mapping[str, Any], role: str) -> None:
        """Marks the pod as serving ``role`` (no mark: its home role)."""
        meta = pod["metadata"]
        value = None if role == home_role(pod) else role
        self.kube.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                          body={"metadata": {"annotations": {SERVING_ROLE: value}}},
                          content_type="application/merge-patch+json")

    def _switch(self, group: Mapping[str, Any], pods: list[dict[str, Any]], replicas: Mapping[str, int],
                decision: Decision) -> tuple[list[dict[str, Any]], list[str]]:
        """Makes the decision's switches (in parallel); returns the pods as they are after them (switched ones
        annotated) and what went wrong. A switch that does not happen leaves its pod where it was: sizing the
        StatefulSets afterwards scales for it."""
        asks = [(pod, sw.to_role) for sw in decision.switches
                for pod in switch_donors(pods, replicas, sw.from_role, sw.to_role, sw.count)]
        if not asks:
            return pods, []
        meta = group["metadata"]
        started = self.clock()
        errors = self._ask_switches(group, asks)
        notes, switched = [], {}
        for (pod, role), error in zip(asks, errors, strict=True):
            if error is not None:
                notes.append(f"switch to {role} failed, scaling instead: {error}")
                log.warning("planner %s/%s: %s", meta["namespace"], meta["name"], notes[-1])
                continue
            try:
                self._annotate(pod, role)
            except KubeError as exc:  # it serves `role` all the same; the next interval counts it by /health
                notes.append(f"{pod['metadata']['name']} switched to {role}, not annotated: {exc}")
            switched[pod["metadata"]["name"]] = role
            log.info("planner %s/%s: %s switched %s -> %s in %.1f s", meta["namespace"], meta["name"],
                     pod["metadata"]["name"], serving_role(pod), role, self.clock() - started)
        return [with_serving_role(p, switched[p["metadata"]["name"]]) if p["metadata"]["name"] in switched else p
                for p in pods], notes

    def _reassert_switches(self, group: Mapping[str, Any], pods: list[dict[str, Any]],
                           switched: Mapping[str, str]) -> list[str]:
        """Switched pods whose engine reports another role (it restarted in its home role) are asked again."""
        by_name = {p["metadata"]["name"]: p for p in pods if (p.get("status") or {}).get("podIP")}
        candidates = [(by_name[name], role) for name, role in switched.items() if name in by_name]
        reports = list(self._pool.map(lambda c: self._health(c[0]), candidates))
        stray = [(pod, role) for (pod, role), report in zip(candidates, reports, strict=True)
                 if report is not None and report.get("role") != role and not report.get("draining")]
        return [f"{pod['metadata']['name']} came back as {home_role(pod)}; asking it to serve {role} again failed: "
                f"{error}" for (pod, role), error in zip(stray, self._ask_switches(group, stray), strict=True)
                if error is not None]

    def _health(self, pod: Mapping[str, Any]) -> dict[str, Any] | None:
        """The engine's /health answer (None while it does not answer: its probes decide, asked next interval)."""
        try:
            return json.loads(self.fetch(pod_url(pod, DEFAULT_HTTP_PORT, "/health"), SCRAPE_TIMEOUT_S))
        except Exception:
            return None

    def _write_status(self, namespace: str, name: str, planner: Mapping[str, Any]) -> None:
        self.kube.patch_status(GROUP_API_VERSION, GROUP_KIND, namespace, name, {"planner": dict(planner)})
