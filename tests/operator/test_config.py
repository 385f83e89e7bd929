"""`splitserve operator`'s flags: every namespace by default, --namespaces narrows it."""

from __future__ import annotations

import pytest

from splitserve.config_flags import parse_config
from splitserve.operator.config import OperatorConfig


def test_no_flags_watch_every_namespace() -> None:
    config = parse_config(OperatorConfig, [], prefix="SPLITSERVE", prog="splitserve operator")
    assert config.cluster_wide and config.namespaces == []


def test_namespaces_narrow_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config(OperatorConfig, ["--namespaces", "a", "b-*"], prefix="SPLITSERVE", prog="op")
    assert not config.cluster_wide and config.namespaces == ["a", "b-*"]
    monkeypatch.setenv("SPLITSERVE_NAMESPACES", "c,d")
    assert parse_config(OperatorConfig, [], prefix="SPLITSERVE", prog="op").namespaces == ["c", "d"]
