"""Which pod serves which role after runtime switches, and how the planner's targets become StatefulSet sizes
(operator/role_switch.py), and one planner interval that switches an idle decode to prefill."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.operator.planner_loop import PlannerLoop
from splitserve.operator.role_switch import SERVING_ROLE, serving, statefulset_sizes, switch_donors


def pod(name: str, serves: str | None = None, ready: bool = True, ip: str = "10.0.0.9",
        deleting: bool = False) -> dict[str, Any]:
    role = name.split("-")[1]
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": {"splitserve.io/role": role}}
    if serves:
        meta["annotations"] = {SERVING_ROLE: serves}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_switched_pod_counts_under_the_role_it_serves() -> None:
    pods = [pod("g-prefill-0"), pod("g-decode-0"), pod("g-decode-1", serves="prefill"), pod("g-router-x")]
    view = serving(pods, {"prefill": 1, "decode": 2})
    assert view.replicas == {"prefill": 2, "decode": 1} and view.ready == {"prefill": 2, "decode": 1}
    assert view.switched == {"g-decode-1": "prefill"}
    # A pod past its StatefulSet's size (being removed) or being deleted counts nowhere; one not created yet
    # counts in its home role, and not as ready.
    pods.append(pod("g-decode-2", serves="prefill", deleting=True))
    view = serving(pods, {"prefill": 2, "decode": 2})
    assert view.replicas == {"prefill": 3, "decode": 1} and view.ready == {"prefill": 2, "decode": 1}


def test_donors_go_home_first_then_the_highest_ordinals() -> None:
    pods = [pod("g-prefill-0"), pod("g-prefill-1"), pod("g-prefill-2", ready=False), pod("g-decode-0"),
            pod("g-decode-1", serves="prefill")]
    replicas = {"prefill": 3, "decode": 2}
    names = [p["metadata"]["name"] for p in switch_donors(pods, replicas, "prefill", "decode", 3)]
    assert names == ["g-decode-1", "g-prefill-1", "g-prefill-0"]  # not the one that is not ready
    assert switch_donors(pods, replicas, "decode", "prefill", 0) == []


def test_targets_become_statefulset_sizes() -> None:
    pods = [pod("g-prefill-0"), pod("g-decode-0"), pod("g-decode-1", serves="prefill")]
    replicas = {"prefill": 1, "decode": 2}  # serving 2P1D
    # Prefill back to one: the switched pod goes (the top of decode's StatefulSet), not prefill-0.
    assert statefulset_sizes(pods, replicas, {"prefill": 1, "decode": 1}) == ({"prefill": 1, "decode": 1},
                                                                              {"prefill": 0, "decode": 0})
    # More decode: its own StatefulSet grows (a new pod serves its home role).
    assert statefulset_sizes(pods, replicas, {"prefill": 2, "decode": 2})[0] == {"prefill": 1, "decode": 3}
    # Fewer decode: decode-0 serves decode but is not at the top of its StatefulSet, prefill's top serves
    # prefill: nothing to shed this time, said so.
    assert statefulset_sizes(pods, replicas, {"prefill": 2, "decode": 0}) == ({"prefill": 1, "decode": 2},
                                                                              {"prefill": 0, "decode": 1})
    # Both at once: prefill grows by its own StatefulSet, decode sheds nothing switched.
    assert statefulset_sizes(pods, replicas, {"prefill": 3, "decode": 1})[0] == {"prefill": 2, "decode": 2}


class Kube:
    """The API calls one planner interval makes, recorded (the loop's contract with the API server)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods, self.requests, self.statuses = pods, [], []

    def list(self, *_a: Any, **_k: Any) -> list[dict[str, Any]]:
        return self.pods

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, name) == ("Secret", "g-control")
        return {"data": {"key": "c2VjcmV0"}}  # "secret"

    def request(self, method: str, path: str, body: Any = None, content_type: str = "") -> dict[str, Any]:
        self.requests.append((method, path, body))
        return {}

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Any) -> dict[str, Any]:
        self.statuses.append(status["planner"])
        return {}


ENGINE = """# TYPE splitserve_requests_waiting gauge
splitserve_requests_waiting{model="m"} WAITING
# TYPE splitserve_prompt_tokens_total counter
splitserve_prompt_tokens_total{model="m"} PROMPT
# TYPE splitserve_requests_finished_total counter
splitserve_requests_finished_total{model="m",reason="length"} FINISHED
# TYPE splitserve_generation_tokens_total counter
splitserve_generation_tokens_total{model="m"} GENERATED
# TYPE splitserve_time_to_first_token_seconds histogram
splitserve_time_to_first_token_seconds_bucket{model="m",le="0.5"} 0
splitserve_time_to_first_token_seconds_bucket{model="m",le="+Inf"} SLOW
splitserve_time_to_first_token_seconds_count{model="m"} SLOW
splitserve_time_to_first_token_seconds_sum{model="m"} 0
"""


def engine(waiting: int = 0, prompt: int = 0, finished: int = 0, slow: int = 0, generated: int = 0) -> str:
    return (ENGINE.replace("WAITING", str(waiting)).replace("PROMPT", str(prompt)).replace("FINISHED", str(finished))
            .replace("SLOW", str(slow)).replace("GENERATED", str(generated)))


def two_intervals(group: dict, pods: list[dict], replicas: dict[str, int], fetch, post) -> Kube:
    """A planner loop over `group` (its ServingRoles at `replicas`) run for two intervals, 5 s apart; its Kube."""
    roles = {("ServingRole", "ns", f"g-{r}"): {"spec": {"replicas": n}} for r, n in replicas.items()}
    objects = {("ServingGroup", "ns", "g"): group, **roles}
    now = [0.0]
    kube = Kube(pods)
    loop = PlannerLoop(kube, lambda kind, ns, name: objects.get((kind, ns, name)), lambda: [("ns", "g")],
                       fetch=fetch, clock=lambda: now[0], post=post)
    loop.tick()
    now[0] = 5.0
    loop.tick()
    loop.stop()
    return kube


@pytest.mark.parametrize("answer", [200, 409])
def test_an_interval_switches_an_idle_decode_to_prefill_or_scales_when_it_is_refused(answer: int) -> None:
    group = {"metadata": {"namespace": "ns", "name": "g", "uid": "u"},
             "spec": {"slo": {"enabled": True, "ttftSeconds": 0.5, "itlSeconds": 0.1, "intervalSeconds": 5,
                              "scaleDownIntervals": 1, "roles": {"prefill": {"maxReplicas": 2},
                                                                 "decode": {"maxReplicas": 2}}}}}
    pods = [pod("g-prefill-0", ip="10.0.0.1"), pod("g-decode-0", ip="10.0.0.2"), pod("g-decode-1", ip="10.0.0.3")]
    # Long prompts queue at the one prefill (TTFT past the target); the decodes finish what they get at once.
    texts = {"10.0.0.1": [engine(), engine(waiting=6, prompt=20 * 3000, finished=20, slow=20)],
             "10.0.0.2": [engine(), engine(finished=10, generated=80)],
             "10.0.0.3": [engine(), engine(finished=10, generated=80)]}
    calls: dict[str, int] = {}

    def fetch(url: str, timeout: float) -> str:
        host = url.split("//")[1].split(":")[0]
        calls[host] = calls.get(host, 0) + 1
        return texts[host][min(calls[host], 2) - 1]

    asked = []

    def post(url: str, body: dict, headers: dict, timeout: float) -> tuple[int, str]:
        asked.append((url, body["role"], headers))
        return answer, "{}" if answer == 200 else '{"error": {"message": "engine core in its own process"}}'

    kube = two_intervals(group, pods, {"prefill": 1, "decode": 2}, fetch, post)
    # The highest decode ordinal was asked to serve prefill, with the group's key.
    assert asked == [("http://10.0.0.3:8000/internal/role", "prefill", {"X-Splitserve-Key": "secret"})]
    status = kube.statuses[-1]
    assert status["current"] == "1:2" and status["desired"] == "2:1"
    if answer == 200:  # annotated, no pod started or stopped: 2P1D at once
        assert kube.requests == [("PATCH", "/api/v1/namespaces/ns/pods/g-decode-1",
                                  {"metadata": {"annotations": {SERVING_ROLE: "prefill"}}})]
        assert status["serving"] == "2:1" and status["switched"] == "g-decode-1 serves prefill"
    else:  # refused: scaled instead (one prefill pod more, decode-1 drained), and the status says why
        assert sorted((p, b["spec"]["replicas"]) for _m, p, b in kube.requests) == [
            ("/apis/splitserve.io/v1alpha1/namespaces/ns/servingroles/g-decode/scale", 1),
            ("/apis/splitserve.io/v1alpha1/namespaces/ns/servingroles/g-prefill/scale", 2)]
        assert status["serving"] == "2:1" and status.get("switched") is None
        assert "switch to prefill failed, scaling instead" in status["message"] and "409" in status["message"]


def test_a_switched_engine_that_came_back_in_its_home_role_is_asked_again() -> None:
    group = {"metadata": {"namespace": "ns", "name": "g", "uid": "u"},
             "spec": {"slo": {"enabled": True, "ttftSeconds": 5.0, "itlSeconds": 0.5, "intervalSeconds": 5}}}
    pods = [pod("g-prefill-0", ip="10.0.0.1"), pod("g-decode-0", ip="10.0.0.2"),
            pod("g-decode-1", serves="prefill", ip="10.0.0.3"), pod("g-decode-2", serves="prefill", ip="10.0.0.4")]
    health = {"10.0.0.3": '{"status": "ok", "role": "decode", "draining": false}',  # restarted: home again
              "10.0.0.4": '{"status": "ok", "role": "prefill", "draining": false}'}

    def fetch(url: str, timeout: float) -> str:
        host = url.split("//")[1].split(":")[0]
        return health[host] if url.endswith("/health") else engine()

    asked = []

    def post(url: str, body: dict, headers: dict, timeout: float) -> tuple[int, str]:
        asked.append((url, body["role"]))
        return 503, '{"error": {"message": "the drain did not end"}}'

    kube = two_intervals(group, pods, {"prefill": 1, "decode": 3}, fetch, post)
    assert asked == [("http://10.0.0.3:8000/internal/role", "prefill")]  # only the one that came back
    assert "g-decode-1 came back as decode; asking it to serve prefill again failed" in kube.statuses[-1]["message"]
