"""`splitserve serve`: build an engine for the chosen role and serve its HTTP API."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from types import FrameType

import uvicorn

from splitserve.api.engine_client import EngineClient
from splitserve.api.otel import Tracing, TracingUnavailable, otel_endpoint
from splitserve.api.serve_config import ServeConfigs, build_parser, parse_configs
from splitserve.api.server import ApiServer
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.role import Role
from splitserve.engine.role_switch import RoleSwitch
from splitserve.transfer.errors import TransferEngineUnavailableError

logger = logging.getLogger(__name__)


def _exit_on_sigterm(_sig: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def engine_role(configs: ServeConfigs) -> tuple[EngineConfig, Role | None]:
    """The engine's configuration for the chosen role, and the role (raises ValueError or
    FileNotFoundError on flags that do not fit together)."""
    cfg = configs.engine
    role = None
    if cfg.role != "unified" or configs.spec.drafter or configs.spec.peers_file:
        from splitserve.engine.roles import build_role  # the roles need the transfer layer or the draft mesh
        role = build_role(cfg, configs.transfer, configs.spec, epd=configs.epd, images=configs.images)
    if cfg.role == "drafter":
        from splitserve.engine.roles.drafter import drafter_engine_config
        cfg = drafter_engine_config(cfg, overlap=configs.spec.drafter_overlap,
                                    prefix_cache=configs.spec.drafter_prefix_cache)
    return cfg, role


def role_switch(engine: Engine, configs: ServeConfigs) -> RoleSwitch:
    """The engine's runtime role switch (prefill <-> decode; other roles are refused): the same flags,
    another --role."""
    def build(role: str) -> Role:
        from splitserve.engine.roles import build_role  # the roles need the transfer layer
        return build_role(dataclasses.replace(configs.engine, role=role), configs.transfer, configs.spec,
                          epd=configs.epd, images=configs.images)
    return RoleSwitch(engine, build)


def main(argv: list[str]) -> int:
    configs = parse_configs(argv)
    cfg = configs.engine
    logging.getLogger().setLevel(cfg.log_level.upper())
    # The event loop and the engine thread share one interpreter: a shorter interval lets the engine
    # thread back in sooner after each CUDA wait while the loop is busy streaming tokens.
    sys.setswitchinterval(cfg.gil_switch_interval_ms / 1e3)
    try:  # before the engine starts: a missing exporter is said at once
        tracing = Tracing.from_endpoint(otel_endpoint(cfg.otel_endpoint), f"splitserve-{cfg.role}")
    except TracingUnavailable as exc:
        logger.error("cannot start: %s", exc)
        return 1
    try:
        split = cfg.runs_engine_process()
    except ValueError as exc:  # --device cuda on a machine without one
        logger.error("cannot start the engine: %s", exc)
        return 1
    if split:
        from splitserve.api.core_client import CoreClient, CoreStartFailed
        # SIGTERM while the core starts must stop it too: SystemExit unwinds through spawn.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            client: EngineClient | CoreClient = CoreClient.spawn(argv, configs)
        except CoreStartFailed as exc:
            logger.error("cannot start the engine core: %s", exc)
            return 1
        stop = client.stop
    else:
        parser = build_parser()
        try:
            engine_cfg, role = engine_role(configs)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
        try:
            engine = Engine(engine_cfg, role=role)
            engine.start()
        except (FileNotFoundError, ValueError, MemoryError, OSError, TransferEngineUnavailableError) as exc:
            logger.error("cannot start the engine: %s", exc)
            return 1
        client = EngineClient(engine, role_switch(engine, configs))
        stop = engine.stop
    server = ApiServer(client, configs.images, control_key=configs.transfer.transfer_control_key, tracing=tracing)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal; as SystemExit it lets
    # the `finally` below stop the engine (and its tensor-parallel workers) before the process ends.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logger.info("serving %s (role %s) on http://%s:%d", cfg.model_name, cfg.role, cfg.host, cfg.port)
    try:
        uvicorn.run(server.app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        stop()
        if tracing is not None:
            tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
