"""The operator's planner wiring without a cluster: Prometheus text -> an Observation, a Decision -> scale
patches and status, and one interval of the loop against a fake API and fake scrapes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.engine.metrics import LATENCY_BUCKETS, EngineMetrics
from splitserve.operator.crds import serving_group_schema
from splitserve.operator.group_builders import build_engine_network_policy
from splitserve.operator.planner_loop import PlannerLoop, group_targets
from splitserve.operator.planner_metrics import (
    PodScrape,
    bucket_increase,
    counter_increase,
    histogram_buckets,
    histogram_quantile,
    observation,
    parse_metrics,
    planner_config,
    planner_status,
    scale_body,
    scale_patches,
    summarize,
)
from splitserve.operator.rollout import group_revision
from splitserve.operator.status import group_status
from splitserve.operator.validation import group_spec_problems
from splitserve.planner.policy import Decision, RoleChange


def engine_text(ttft: list[float] = (), itl: list[float] = (), waiting: int = 0, running: int = 0,
                kv: tuple[int, int] = (0, 100), prompt: int = 0, generated: int = 0, finished: int = 0) -> str:
    m = EngineMetrics("tiny")
    for v in ttft:
        m.ttft.observe(v)
    for v in itl:
        m.itl.observe(v)
    m.waiting.set(waiting)
    m.running.set(running)
    m.kv_used.set(kv[0])
    m.kv_free.set(kv[1])
    m.prompt_tokens.inc(prompt)
    m.generation_tokens.inc(generated)
    for _ in range(finished):
        m.finished("stop")
    return generate_latest(m.registry).decode()


def router_text(requests: int) -> str:
    registry = CollectorRegistry()
    c = Counter("splitserve_router_requests", "Requests routed", ["outcome"], registry=registry)
    c.labels("ok").inc(requests - 1)
    c.labels("error").inc(1)
    Gauge("splitserve_router_requests_in_flight", "x", registry=registry).set(3)
    return generate_latest(registry).decode()


def test_parse_reads_counters_histograms_and_gauges_as_the_engines_export_them() -> None:
    samples = parse_metrics(engine_text(ttft=[0.2, 0.4], waiting=3, prompt=100, finished=2))
    assert samples[("splitserve_requests_waiting", (("model", "tiny"),))] == 3
    assert samples[("splitserve_prompt_tokens_total", (("model", "tiny"),))] == 100
    buckets = histogram_buckets(samples, "splitserve_time_to_first_token_seconds")
    assert buckets[math.inf] == 2 and buckets[0.25] == 1 and buckets[0.15] == 0
    assert len(buckets) == len(LATENCY_BUCKETS) + 1


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 0.0, 0.5: 50.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 40 / 50)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1 + 0.4 * 25 / 50)
    # Ranks in +Inf: the largest finite bound. No observations: None.
    assert histogram_quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0
    assert histogram_quantile(0.9, {1.0: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.9, {}) is None


def test_counter_and_bucket_increases_count_a_restart_from_zero() -> None:
    assert counter_increase(15, 10) == 5
    assert counter_increase(4, 10) == 4  # restarted
    assert counter_increase(7, None) == 7  # a new pod
    assert bucket_increase({1.0: 5, math.inf: 8}, {1.0: 2, math.inf: 3}) == {1.0: 3, math.inf: 5}
    assert bucket_increase({1.0: 1, math.inf: 1}, {1.0: 2, math.inf: 3}) == {1.0: 1, math.inf: 1}


def test_summarize_turns_two_scrapes_into_an_interval() -> None:
    before = {
        "p-0": parse_metrics(engine_text(ttft=[0.01] * 10, prompt=1000, finished=10)),
        "d-0": parse_metrics(engine_text(ttft=[0.02] * 10, itl=[0.004] * 100, generated=100, finished=10)),
        "r-0": parse_metrics(router_text(10)),
    }
    # 15 s later: 30 more requests of 200 prompt tokens and 20 output tokens, slow first tokens at decode.
    after = [
        PodScrape("prefill", "p-0", parse_metrics(engine_text(ttft=[0.01] * 40, waiting=2, prompt=7000,
                                                              finished=40))),
        PodScrape("decode", "d-0", parse_metrics(engine_text(ttft=[0.02] * 10 + [0.7] * 30,
                                                             itl=[0.004] * 100 + [0.04] * 600, running=5,
                                                             kv=(30, 70), generated=700, finished=40))),
        PodScrape("decode", "d-1", None),  # not answering: counted, not used
        PodScrape("router", "r-0", parse_metrics(router_text(40))),
    ]
    interval = summarize(after, before, 15.0, 0.9)
    assert interval.arrival_rate == pytest.approx(30 / 15)
    assert interval.prompt_tokens == pytest.approx(200)
    assert interval.output_tokens == pytest.approx(20)
    # Only this interval's observations: all 30 TTFTs in (0.5, 0.75], all 600 gaps in (0.025, 0.05].
    assert 0.5 < interval.ttft_s <= 0.75
    assert 0.025 < interval.itl_s <= 0.05
    assert interval.waiting == {"prefill": 2, "decode": 0}
    assert interval.running_decodes == [5]
    assert interval.kv_usage == [pytest.approx(0.3)]
    assert interval.prefill_queue_tokens == 400
    assert interval.scraped["decode"] == (1, 2)

    obs = observation(interval, 100.0, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 1})
    assert obs.replicas == {"prefill": 1, "decode": 2} and obs.ready_count("decode") == 1
    assert obs.prompt_tokens == pytest.approx(200) and obs.arrival_rate == pytest.approx(2)


def test_ttft_falls_back_to_prefill_and_lengths_to_the_last_seen() -> None:
    after = [PodScrape("prefill", "p-0", parse_metrics(engine_text(ttft=[0.3] * 5)))]
    interval = summarize(after, {}, 10.0, 0.5)
    assert 0.25 < interval.ttft_s <= 0.5
    assert interval.itl_s is None
    obs = observation(interval, 0.0, {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, (512.0, 64.0))
    assert (obs.prompt_tokens, obs.output_tokens) == (512.0, 64.0)


def test_planner_config_from_the_spec() -> None:
    config = planner_config({"ttftSeconds": 2, "itlSeconds": 0.05, "percentile": 99, "intervalSeconds": 10,
                             "roles": {"decode": {"minReplicas": 2, "maxReplicas": 6}}})
    assert config.slo.ttft_s == 2.0 and config.slo.itl_s == 0.05 and config.slo.percentile == pytest.approx(0.99)
    assert config.interval_s == 10.0 and config.startup_s == 120.0
    assert (config.limits["decode"].min, config.limits["decode"].max) == (2, 6)
    assert (config.limits["prefill"].min, config.limits["prefill"].max) == (1, 8)
    assert config.allow_switch is True  # engines switch roles before pods start
    assert planner_config({"ttftSeconds": 2, "itlSeconds": 0.05, "roleSwitch": False}).allow_switch is False


def test_a_decision_becomes_scale_patches_and_a_status() -> None:
    decision = Decision({"prefill": 3, "decode": 2},
                        [RoleChange("prefill", 1, 3, "scale up: TTFT p90 4.00 s > 2.0 s")], [], 4.0)
    assert scale_patches(decision, {"prefill": 1, "decode": 2}) == {"prefill": 3}
    assert scale_body(3) == {"spec": {"replicas": 3}}
    interval = summarize([], {}, 15.0, 0.9)
    interval.ttft_s = 4.0
    obs = observation(interval, 0.0, {"prefill": 1, "decode": 2}, {"prefill": 1, "decode": 2})
    status = planner_status(interval, obs, decision, "2026-01-01T00:00:00Z", None)
    assert status["current"] == "1:2" and status["desired"] == "3:2"
    assert status["replicas"]["prefill"] == {"current": 1, "desired": 3}
    assert status["lastDecision"].startswith("prefill 1 -> 3: scale up: TTFT")
    assert status["observed"]["ttftSeconds"] == 4.0
    # No change: the last decision is kept, the message says why nothing changed.
    same = Decision({"prefill": 1, "decode": 2}, [], [], 0.0)
    later = planner_status(interval, obs, same, "2026-01-01T00:00:15Z", status)
    assert later["lastDecision"] == status["lastDecision"] and later["message"].startswith("no change")
    # Every key written is in the CRD's status schema (the API server would prune the rest).
    schema = serving_group_schema()["properties"]["status"]["properties"]["planner"]["properties"]
    assert set(status) <= set(schema) and set(status["observed"]) <= set(schema["observed"]["properties"])


GROUP: dict[str, Any] = {
    "apiVersion": "splitserve.io/v1alpha1", "kind": "ServingGroup",
    "metadata": {"name": "g", "namespace": "ns", "uid": "u-1", "generation": 1},
    "spec": {"model": {"name": "m", "builtin": "tiny"},
             "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
             "slo": {"enabled": True, "ttftSeconds": 0.5, "itlSeconds": 0.05, "percentile": 90,
                     "intervalSeconds": 5, "roles": {"prefill": {"minReplicas": 1, "maxReplicas": 3}}}},
}


def test_slo_is_outside_the_pod_revision_and_checked_across_fields() -> None:
    import copy
    changed = copy.deepcopy(GROUP["spec"])
    changed["slo"]["ttftSeconds"] = 9
    assert group_revision(changed) == group_revision(GROUP["spec"])
    bad = copy.deepcopy(GROUP["spec"])
    bad["slo"]["roles"]["prefill"] = {"minReplicas": 4, "maxReplicas": 2}
    assert any("minReplicas (4) is above its maxReplicas (2)" in p for p in group_spec_problems("g", bad))
    assert group_spec_problems("g", GROUP["spec"]) == []


def test_the_engine_policy_admits_the_operator_to_scrape_only_with_the_planner() -> None:
    on = build_engine_network_policy(GROUP)["spec"]["ingress"]
    assert len(on) == 2 and on[1]["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert on[1]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "splitserve-operator"}
    off = {**GROUP, "spec": {k: v for k, v in GROUP["spec"].items() if k != "slo"}}
    assert len(build_engine_network_policy(off)["spec"]["ingress"]) == 1


def test_group_status_shows_actual_and_desired_pd() -> None:
    def role(desired: int, ready: int) -> dict[str, Any]:
        return {"spec": {"replicas": desired}, "status": {"readyReplicas": ready, "revision": "r"}}
    status = group_status(GROUP, "r", {"prefill": role(3, 1), "decode": role(2, 2)}, None, 1, "http://x", [],
                          None, "2026-01-01T00:00:00Z")
    assert status["pd"] == "1:2" and status["desiredPD"] == "3:2"


class FakeKube:
    """The API calls the planner loop makes."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods, self.requests, self.statuses = pods, [], []

    def list(self, api_version: str, kind: str, namespace: str, labels: Any = None, from_cache: bool = False):
        assert (kind, labels, from_cache) == ("Pod", {"splitserve.io/group": "g"}, True)
        return self.pods

    def request(self, method: str, path: str, body: Any = None, content_type: str = "") -> dict[str, Any]:
        self.requests.append((method, path, body, content_type))
        return {}

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Any) -> dict[str, Any]:
        self.statuses.append(status["planner"])
        return {}


def pod(name: str, role: str, ip: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "labels": {"splitserve.io/role": role}},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


def test_one_interval_of_the_loop_scales_prefill_through_the_scale_subresource() -> None:
    pods = [pod("g-prefill-0", "prefill", "10.0.0.1"), pod("g-decode-0", "decode", "10.0.0.2"),
            pod("g-router-x", "router", "10.0.0.3"), pod("g-encode-0", "encode", "10.0.0.4")]
    assert [t[2] for t in group_targets(pods, GROUP["spec"])] == [
        "http://10.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics", "http://10.0.0.3:8000/metrics"]
    texts = {"10.0.0.1": [engine_text(), engine_text(ttft=[2.0] * 20, waiting=8, prompt=20 * 300, finished=20)],
             "10.0.0.2": [engine_text(), engine_text(ttft=[2.0] * 20, itl=[0.01] * 200, running=2, kv=(10, 90),
                                                     generated=200, finished=20)],
             "10.0.0.3": [router_text(1), router_text(21)]}
    calls: dict[str, int] = {}

    def fetch(url: str, timeout: float) -> str:
        host = url.split("//")[1].split(":")[0]
        calls[host] = calls.get(host, 0) + 1
        return texts[host][min(calls[host], 2) - 1]

    roles = {("ServingRole", "ns", f"g-{r}"): {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
             for r in ("prefill", "decode")}
    objects = {("ServingGroup", "ns", "g"): GROUP, **roles}
    now = [0.0]
    kube = FakeKube(pods)
    loop = PlannerLoop(kube, lambda kind, ns, name: objects.get((kind, ns, name)), lambda: [("ns", "g")],
                       fetch=fetch, clock=lambda: now[0])
    loop.tick()  # the baseline
    assert kube.requests == [] and "baseline" in kube.statuses[-1]["message"]
    now[0] = 5.0
    loop.tick()
    # p90 TTFT 2 s against 0.5 s with prompts queued: one more prefill, through the scale subresource.
    method, path, body, content_type = kube.requests[0]
    assert (method, path) == ("PATCH", "/apis/splitserve.io/v1alpha1/namespaces/ns/servingroles/g-prefill/scale")
    assert body["spec"]["replicas"] >= 2 and content_type == "application/merge-patch+json"
    status = kube.statuses[-1]
    assert status["current"] == "1:1" and status["desired"].startswith(f"{body['spec']['replicas']}:")
    assert "prefill 1 -> " in status["lastDecision"]
    assert status["observed"]["arrivalRate"] == pytest.approx(4.0)
    sample = loop.metrics.registry.get_sample_value
    assert sample("splitserve_planner_desired_replicas", {"namespace": "ns", "group": "g", "role": "prefill"}) \
        == body["spec"]["replicas"]
    assert sample("splitserve_planner_decisions_total", {"namespace": "ns", "group": "g", "role": "prefill",
                                                         "direction": "up"}) == 1
    # Not due again before its interval; a group without slo.enabled is never planned.
    loop.tick()
    assert len(kube.statuses) == 2
    objects[("ServingGroup", "ns", "g")] = {**GROUP, "spec": {**GROUP["spec"], "slo": {**GROUP["spec"]["slo"],
                                                                                       "enabled": False}}}
    now[0] = 20.0
    loop.tick()
    assert len(kube.statuses) == 2 and loop._planners == {}
    loop.stop()


def test_the_top_quantile_of_one_observation_is_its_bucket_bound() -> None:
    # The engines' histograms are prometheus_client Histograms with these buckets (the dashboard and the
    # quantiles assume le labels from LATENCY_BUCKETS).
    registry = CollectorRegistry()
    Histogram("x_seconds", "x", buckets=LATENCY_BUCKETS, registry=registry).observe(0.3)
    assert histogram_quantile(1.0, histogram_buckets(parse_metrics(generate_latest(registry).decode()),
                                                     "x_seconds")) == 0.5


# Scale-down drains -------------------------------------------------------------------------------------------


def test_engine_pods_drain_before_sigterm_and_the_router_watches_only_serving_pods() -> None:
    from splitserve.operator.names import LABEL_ROLE
    from splitserve.operator.role_builders import build_role_children

    role = {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingRole",
            "metadata": {"name": "g-decode", "namespace": "ns", "uid": "r-1",
                         "labels": {"splitserve.io/group": "g", LABEL_ROLE: "decode"}},
            "spec": {"group": "g", "role": "decode", "model": {"name": "m", "builtin": "tiny"}}}
    peers, serving, sts = build_role_children(role, "img")
    # The peer Service keeps terminating pods (publishNotReadyAddresses): no role label, the router ignores it.
    assert peers["spec"]["publishNotReadyAddresses"] is True and LABEL_ROLE not in peers["metadata"]["labels"]
    # The serving Service: ready pods only; a terminating pod leaves its Endpoints at once.
    assert serving["metadata"]["name"] == "g-decode-serving"
    assert serving["metadata"]["labels"][LABEL_ROLE] == "decode"
    assert serving["metadata"]["labels"]["splitserve.io/group"] == "g"
    assert "publishNotReadyAddresses" not in serving["spec"]
    assert serving["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "python3", "-m", "splitserve.operator.prestop", "--port", "8000", "--settle", "5", "--timeout", "120"]
    assert pod["terminationGracePeriodSeconds"] == 130
    role["spec"]["drainSeconds"] = 600
    (container,) = build_role_children(role, "img")[2]["spec"]["template"]["spec"]["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1] == "600"


def test_an_update_drops_the_role_label_the_peer_service_no_longer_carries() -> None:
    from splitserve.operator.kube import merge_for_update
    from splitserve.operator.role_builders import build_headless_service

    role = {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingRole",
            "metadata": {"name": "g-decode", "namespace": "ns", "uid": "r-1"},
            "spec": {"group": "g", "role": "decode", "model": {"name": "m", "builtin": "tiny"}}}
    desired = build_headless_service(role)
    existing = {**desired, "metadata": {**desired["metadata"], "labels": {
        **desired["metadata"]["labels"], "splitserve.io/role": "decode", "team": "a"}}}
    labels = merge_for_update(existing, desired)["metadata"]["labels"]
    assert "splitserve.io/role" not in labels and labels["team"] == "a"


def test_prestop_waits_for_the_engine_to_be_idle() -> None:
    from splitserve.operator.prestop import in_flight, wait_idle

    assert in_flight(engine_text(waiting=2, running=3)) == 5
    busy = [engine_text(running=2), engine_text(running=1), engine_text(), engine_text(), engine_text(running=9)]
    t = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        t[0] += s

    assert wait_idle("u", 5, 60, clock=lambda: t[0], sleep=sleep, fetch=lambda _u: busy.pop(0)) == "idle"
    assert sleeps[0] == 5 and len(busy) == 1  # settled first, then two quiet polls in a row
    assert wait_idle("u", 1, 3, clock=lambda: t[0], sleep=sleep,
                     fetch=lambda _u: engine_text(running=1)) == "timeout"

    def gone(_u: str) -> str:
        raise OSError("connection refused")

    assert wait_idle("u", 0, 3, clock=lambda: t[0], sleep=sleep, fetch=gone) == "gone"
