"""The operator's configuration: one dataclass, built from flags and SPLITSERVE_* env vars."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OperatorConfig:
    """How the operator runs: which namespaces it watches, its defaults and its endpoints."""

    namespaces: list[str] = field(default_factory=list, metadata={
        "help": "watch only these namespaces (several, globs allowed, or comma-separated in the env var); "
                "default: every namespace (needs the ClusterRole)"})
    default_image: str = field(default="ghcr.io/splitserve/splitserve:0.1.0", metadata={
        "help": "engine and router image for groups and roles that name none"})
    router_cluster_role: str = field(default="splitserve-router", metadata={
        "help": "ClusterRole (from the chart) bound to each group's router ServiceAccount: read Endpoints"})
    liveness_port: int = field(default=8080, metadata={
        "help": "port of the /healthz liveness endpoint (0 disables it)"})
    liveness_host: str = field(default="0.0.0.0", metadata={"help": "address of the liveness endpoint"})
    metrics_port: int = field(default=0, metadata={
        "help": "port of the operator's Prometheus /metrics (the SLO planner's splitserve_planner_* gauges); "
                "0: none (the chart sets 8081)"})
    resync_seconds: float = field(default=600.0, metadata={
        "help": "period of the level-based resync of every group and role (a safety net: events of the "
                "children repair drift as it happens, and each period costs a full reconcile of every object)"})
    workers: int = field(default=16, metadata={
        "help": "threads running reconciles (each mostly waits on the API server; one object is never "
                "reconciled by two at once)"})
    kubeconfig: str = field(default="", metadata={
        "help": "kubeconfig file (default: in-cluster config, then $KUBECONFIG / ~/.kube/config)"})
    verbose: bool = field(default=False, metadata={"help": "debug logging"})

    @property
    def cluster_wide(self) -> bool:
        """Whether every namespace is watched (no --namespaces given)."""
        return not self.namespaces

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.resync_seconds <= 0:
            raise ValueError(f"--resync-seconds must be > 0, got {self.resync_seconds}")
        if not 0 <= self.liveness_port <= 65535:
            raise ValueError(f"--liveness-port must be within 0..65535, got {self.liveness_port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be within 0..65535, got {self.metrics_port}")
