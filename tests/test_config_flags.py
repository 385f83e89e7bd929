"""Config dataclasses become flags and env vars that match; bad values fail clearly."""

from __future__ import annotations

import argparse

import pytest
import torch

from splitserve.config_flags import ConfigError, add_config_flags, config_from_args
from splitserve.engine.config import EngineConfig


def parse(argv: list[str], env: dict[str, str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, "SPLITSERVE")
    return config_from_args(EngineConfig, parser.parse_args(argv), "SPLITSERVE", environ=env)


def test_flag_beats_env_beats_default() -> None:
    assert parse([], {}).page_size == 16
    assert parse([], {"SPLITSERVE_PAGE_SIZE": "32"}).page_size == 32
    assert parse(["--page-size", "8"], {"SPLITSERVE_PAGE_SIZE": "32"}).page_size == 8


def test_booleans_and_optionals_from_env() -> None:
    cfg = parse([], {"SPLITSERVE_DISABLE_PREFIX_CACHE": "true", "SPLITSERVE_MAX_TOTAL_TOKENS": "1024"})
    assert cfg.disable_prefix_cache is True and cfg.max_total_tokens == 1024
    assert parse(["--disable-prefix-cache"], {}).disable_prefix_cache is True


def test_the_engine_core_runs_in_its_own_process_by_default_on_a_gpu_only() -> None:
    """--engine-process: unset, on with a CUDA device and off on the CPU; either flag or the env var decides."""
    assert parse(["--device", "cpu"], {}).engine_process is None
    assert parse(["--device", "cpu"], {}).runs_engine_process() is False
    assert parse(["--device", "cpu", "--engine-process"], {}).runs_engine_process() is True
    assert parse(["--device", "cpu"], {"SPLITSERVE_ENGINE_PROCESS": "1"}).runs_engine_process() is True
    assert parse(["--no-engine-process"], {"SPLITSERVE_ENGINE_PROCESS": "1"}).runs_engine_process() is False
    if torch.cuda.is_available():
        assert parse(["--device", "cuda"], {}).runs_engine_process() is True
    else:  # asked for a GPU this machine lacks: the same error the engine gives, not a silent one-process server
        with pytest.raises(ValueError, match="no CUDA device"):
            parse(["--device", "cuda"], {}).runs_engine_process()


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="SPLITSERVE_PAGE_SIZE: expected int, got 'big'"):
        parse([], {"SPLITSERVE_PAGE_SIZE": "big"})
    with pytest.raises(ConfigError, match="SPLITSERVE_ROLE: 'chef' is not one of"):
        parse([], {"SPLITSERVE_ROLE": "chef"})


def test_max_running_requests_default_follows_the_device() -> None:
    from splitserve.engine.config import CPU_MAX_RUNNING_REQUESTS, CUDA_MAX_RUNNING_REQUESTS

    assert EngineConfig(device="cpu").max_running_requests == CPU_MAX_RUNNING_REQUESTS == 64
    assert EngineConfig(device="cuda:1").max_running_requests == CUDA_MAX_RUNNING_REQUESTS == 256
    assert EngineConfig(device="cuda", max_running_requests=8).max_running_requests == 8  # a flag wins
    with pytest.raises(ValueError, match="--max-running-requests must be >= 1"):
        EngineConfig(device="cpu", max_running_requests=-1)
