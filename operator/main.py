"""`splitserve operator`: runs the kopf operator for ServingGroups and ServingRoles."""

from __future__ import annotations

import logging
import os

import kopf
import kubernetes
from prometheus_client import start_http_server

from splitserve.config_flags import parse_config
from splitserve.operator.config import OperatorConfig
from splitserve.operator.handlers import CACHED_KINDS, Reconciler, operator_settings, register_handlers
from splitserve.operator.kube import Kube

log = logging.getLogger(__name__)


def api_client(config: OperatorConfig, pool_size: int) -> kubernetes.client.ApiClient:
    """A client for the API server: the given kubeconfig, in-cluster, or the default kubeconfig.

    ``pool_size``: kept connections; the default (5 per CPU) is below the worker threads, and each
    request beyond it opened (and the API server paid for) a new TLS connection.
    """
    client_config = kubernetes.client.Configuration()
    if config.kubeconfig:
        # kopf's own login reads $KUBECONFIG too, so both talk to the same server.
        os.environ["KUBECONFIG"] = config.kubeconfig
        kubernetes.config.load_kube_config(config_file=config.kubeconfig, client_configuration=client_config)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=client_config)
    else:
        kubernetes.config.load_kube_config(client_configuration=client_config)
    client_config.connection_pool_maxsize = pool_size
    return kubernetes.client.ApiClient(client_config)


def main(argv: list[str]) -> int:
    """Parses the operator's flags and runs it until SIGTERM/SIGINT."""
    config = parse_config(OperatorConfig, argv, prefix="SPLITSERVE", prog="splitserve operator",
                          description="Reconciles ServingGroups and ServingRoles (splitserve.io/v1alpha1).")
    if config.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    registry = kopf.OperatorRegistry()
    # Reconciles run on --workers threads, the resync's retries on timers: room for both.
    reconciler = Reconciler(Kube(api_client(config, config.workers + 4)), config,
                            cache_api=api_client(config, len(CACHED_KINDS) + 2))
    register_handlers(registry)
    if config.metrics_port:
        try:
            start_http_server(config.metrics_port, config.liveness_host, registry=reconciler.planner.metrics.registry)
        except OSError as exc:  # the planner works without it
            log.warning("no /metrics on port %d: %s", config.metrics_port, exc)
    reconciler.start()
    liveness = (f"http://{config.liveness_host}:{config.liveness_port}/healthz"
                if config.liveness_port else None)
    log.info("splitserve operator: %s, resync every %.0fs, default image %s",
             "cluster-wide" if config.cluster_wide else f"namespaces {', '.join(config.namespaces)}",
             config.resync_seconds, config.default_image)
    kopf.run(registry=registry, settings=operator_settings(), standalone=True,
             clusterwide=config.cluster_wide, namespaces=config.namespaces, liveness_endpoint=liveness)
    return 0
