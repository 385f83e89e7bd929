"""`splitserve router`: the OpenAI-compatible front door of a deployment.

Disaggregated (`--prefill URL... --decode URL...`, or `--kube-group G` in Kubernetes, which watches the
Endpoints of the group's role Services): each request goes to a healthy prefill (see --routing)
and the least-loaded healthy decode at once, with `bootstrap_host/port/room` (and the group key's
signature) telling them where to meet; decode's answer goes back to the client. Before the
first token reaches the client a failed attempt is retried on another decode and another
prefill; after it, a failure ends the stream with an error event. Unified (`--unified URL...`):
proxying to data-parallel replicas (chosen the same way as prefills), with the same retries.

Every engine's `/health` is probed; one that fails its probe, or a request (connect error, 5xx,
timeout), is taken out of rotation and probed again with a growing backoff. The last healthy
engine of a role is not taken out for a failed request alone: it is probed at once, and requests
wait for that verdict. Idle connections to engines are closed before the engines' own keep-alive
timeout, and a request that meets a connection the engine has just closed is sent again on a new
one. `/health` is liveness (with every engine's state), `/ready` readiness, `/metrics` Prometheus.
"""

# The code: backend_pool (engines per role, health, load), health_prober, upstream (engine calls and
# what their failures mean), pair_routing (attempts and retries), app (the HTTP app), config.

from __future__ import annotations

import argparse
import logging
import sys

from splitserve.router.config import RouterConfig
from splitserve.router.pair_routing import pair_request

__all__ = ["RouterConfig", "main", "pair_request"]

logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    import uvicorn

    from splitserve.config_flags import ConfigError, add_config_flags, config_from_args
    from splitserve.engine.multimodal.image_inputs import ImageInputConfig
    from splitserve.router.app import Router

    parser = argparse.ArgumentParser(prog="splitserve router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, RouterConfig, "SPLITSERVE_ROUTER")
    add_config_flags(parser.add_argument_group("Images (sent to --encode engines)"), ImageInputConfig,
                     "SPLITSERVE_ROUTER")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(RouterConfig, args, "SPLITSERVE_ROUTER")
        images = config_from_args(ImageInputConfig, args, "SPLITSERVE_ROUTER")
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    from splitserve.api.otel import TracingUnavailable
    try:
        router = Router(cfg, images)
    except TracingUnavailable as exc:
        parser.error(str(exc))
    logger.info("router on http://%s:%d: prefill %s, decode %s, unified %s", cfg.host, cfg.port, cfg.prefill,
                cfg.decode, cfg.unified)
    uvicorn.run(router.app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5,
                timeout_keep_alive=cfg.client_keepalive_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
