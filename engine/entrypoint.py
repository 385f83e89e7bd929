"""`splitserve serve`: build an engine for the chosen role and serve its HTTP API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

import uvicorn

from splitserve.config_flags import ConfigError, add_config_flags, config_from_args
from splitserve.draft_mesh.config import SpecConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.image_inputs import ImageInputConfig
from splitserve.engine.server import ApiServer
from splitserve.transfer.config import TransferConfig
from splitserve.transfer.errors import TransferEngineUnavailableError

logger = logging.getLogger(__name__)
ENV_PREFIX = "SPLITSERVE"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve serve", description="Run one engine and its HTTP API.")
    add_config_flags(parser, EngineConfig, ENV_PREFIX)
    # The transfer layer's flags (used by --role prefill/decode) live in its own dataclass.
    add_config_flags(parser.add_argument_group("KV transfer (prefill/decode)"), TransferConfig, ENV_PREFIX)
    add_config_flags(parser.add_argument_group("Images (multimodal models)"), ImageInputConfig, ENV_PREFIX)
    add_config_flags(parser.add_argument_group("speculative decoding (drafter; decode/unified with --drafter)"),
                     SpecConfig, ENV_PREFIX)
    add_config_flags(parser.add_argument_group("Encoder disaggregation (encode/prefill)"), EPDConfig, ENV_PREFIX)
    return parser


def _exit_on_sigterm(_sig: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(EngineConfig, args, ENV_PREFIX)
        transfer = config_from_args(TransferConfig, args, ENV_PREFIX)
        images = config_from_args(ImageInputConfig, args, ENV_PREFIX)
        spec = config_from_args(SpecConfig, args, ENV_PREFIX)
        epd = config_from_args(EPDConfig, args, ENV_PREFIX)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    logging.getLogger().setLevel(cfg.log_level.upper())
    # The event loop and the engine thread share one interpreter: a shorter interval lets the engine
    # thread back in sooner after each CUDA wait while the loop is busy streaming tokens.
    sys.setswitchinterval(cfg.gil_switch_interval_ms / 1e3)
    role = None
    if cfg.role != "unified" or spec.drafter or spec.peers_file:
        from splitserve.engine.roles import build_role  # the roles need the transfer layer or the draft mesh
        try:
            role = build_role(cfg, transfer, spec, epd=epd, images=images)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
    if cfg.role == "drafter":
        from splitserve.engine.roles.drafter import drafter_engine_config
        cfg = drafter_engine_config(cfg)
    try:
        engine = Engine(cfg, role=role)
        engine.start()
    except (FileNotFoundError, ValueError, MemoryError, OSError, TransferEngineUnavailableError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 1
    server = ApiServer(engine, images, control_key=transfer.transfer_control_key)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal; as SystemExit it lets
    # the `finally` below stop the engine (and its tensor-parallel workers) before the process ends.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logger.info("serving %s (role %s) on http://%s:%d", cfg.model_name, cfg.role, cfg.host, cfg.port)
    try:
        uvicorn.run(server.app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
