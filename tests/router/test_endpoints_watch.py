"""The router's reading of its group's Endpoints: per role, one URL per address on the `http` port."""

from __future__ import annotations

import pytest

from splitserve.router.endpoints_watch import InClusterAccess, role_urls


def endpoints(role: str, ips: list[str], ports: list[dict] | None = None) -> dict:
    return {"metadata": {"name": f"g-{role}", "labels": {"splitserve.io/group": "g", "splitserve.io/role": role}},
            "subsets": [{"addresses": [{"ip": ip} for ip in ips],
                         "ports": ports or [{"name": "http", "port": 8000}, {"name": "bootstrap", "port": 8998}]}]}


def test_each_role_gets_the_http_url_of_every_address() -> None:
    objects = {"g-prefill": endpoints("prefill", ["10.0.0.2"]),
               "g-decode": endpoints("decode", ["10.0.0.4", "10.0.0.3"]),
               "g-router": endpoints("router", [], [{"name": "http", "port": 8000}]),
               "other": {"metadata": {"name": "other", "labels": {}}, "subsets": []}}
    assert role_urls(objects) == {"prefill": ["http://10.0.0.2:8000"],
                                  "decode": ["http://10.0.0.3:8000", "http://10.0.0.4:8000"], "router": []}


def test_a_subset_without_an_http_port_gives_no_url() -> None:
    objects = {"g-decode": endpoints("decode", ["10.0.0.3"], [{"name": "metrics", "port": 9000}])}
    assert role_urls(objects) == {"decode": []}


def test_outside_a_pod_the_access_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError, match="not in a Kubernetes pod"):
        InClusterAccess.from_pod(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(RuntimeError, match="no service-account token"):
        InClusterAccess.from_pod(tmp_path)
    (tmp_path / "token").write_text("t\n")
    assert InClusterAccess.from_pod(tmp_path).server == "https://10.0.0.1:443"
