"""`splitserve serve`'s configuration: its flags, its config file and its environment.

`--help` lists the flags a user sets (model, role, ports, device, parallelism, memory, transfer
endpoints, drafters); the tuning knobs stay settable in a YAML file (`--config FILE`), through
their environment variables, and as flags that `--help-all` lists (docs/configuration.md says
what each does). Test hooks are environment variables only.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.config_flags import ConfigError, add_config_flags, config_from_args, read_config_file
from splitserve.draft_mesh.config import SpecConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.multimodal.image_inputs import ImageInputConfig
from splitserve.transfer.config import TransferConfig

ENV_PREFIX = "SPLITSERVE"

USER_FLAGS = frozenset({
    # the engine
    "role", "model", "served_model_name", "host", "port", "device", "dtype", "quantization", "log_level",
    "tool_call_parser",
    # memory and batching
    "mem_fraction", "max_total_tokens", "host_kv_tokens", "kv_store", "context_length", "max_running_requests",
    "page_size",
    "chunked_prefill_size", "disable_prefix_cache", "disable_cuda_graph",
    # parallelism
    "tp_size", "dist_init_addr",
    # the KV transfer's endpoints
    "transfer_protocol", "transfer_devices", "transfer_host", "bootstrap_port", "transfer_control_port",
    "embedding_control_port",
    # images and encoder disaggregation
    "allow_image_urls", "max_images_per_request", "encode_cache_size", "embedding_slots",
    # speculative decoding
    "drafter", "num_draft_tokens", "draft_mesh_port", "draft_data_port",
})
# Delays a test injects to hold a transfer or an answer mid-way: environment variables only.
TEST_HOOKS = frozenset({"embedding_write_pause_s", "encode_answer_delay_s"})
SECTIONS: tuple[tuple[str | None, type], ...] = (
    (None, EngineConfig),
    ("KV transfer (prefill/decode)", TransferConfig),
    ("images (multimodal models)", ImageInputConfig),
    ("speculative decoding (drafter; decode or unified with --drafter)", SpecConfig),
    ("encoder disaggregation (encode/prefill)", EPDConfig),
)


@dataclass
class ServeConfigs:
    """Every configuration `serve` reads from its flags, its config file and its env vars."""

    engine: EngineConfig
    transfer: TransferConfig
    images: ImageInputConfig
    spec: SpecConfig
    epd: EPDConfig


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve serve", add_help=False,
        description="Run one engine and its OpenAI-compatible HTTP API. Flags win over environment variables, "
                    "which win over the config file, which wins over the defaults.")
    parser.add_argument("-h", "--help", action="store_true", help="show the user's flags and exit")
    parser.add_argument("--help-all", action="store_true", help="show every flag, tuning knobs included, and exit")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML file of settings by flag name (page_size: 32), tuning knobs included; "
                             "see docs/configuration.md [env SPLITSERVE_CONFIG]")
    for title, cls in SECTIONS:
        group = parser if title is None else parser.add_argument_group(title)
        add_config_flags(group, cls, ENV_PREFIX, shown=USER_FLAGS, omit=TEST_HOOKS, show_all=show_all)
    return parser


def parse_configs(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfigs:
    """Parses `serve`'s flags, config file and environment; exits 2 with the reason on a bad value."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help or args.help_all:
        (build_parser(show_all=True) if args.help_all else parser).print_help()
        raise SystemExit(0)
    try:
        config_path = args.config or environ.get(f"{ENV_PREFIX}_CONFIG")
        file_values = read_config_file(config_path, [cls for _, cls in SECTIONS]) if config_path else {}
        return ServeConfigs(*(config_from_args(cls, args, ENV_PREFIX, environ, file_values) for _, cls in SECTIONS))
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
