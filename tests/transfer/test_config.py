"""TransferConfig as flags and env vars; protocol rdma without a device is a clear error."""

from __future__ import annotations

import argparse

import pytest

from splitserve.config_flags import add_config_flags, config_from_args
from splitserve.transfer import RdmaUnavailableError, TransferConfig
from splitserve.transfer.mooncake.engine import MooncakeEngine, rdma_devices


def test_flags_and_env_build_the_config():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TransferConfig, "SPLITSERVE")
    args = parser.parse_args(["--transfer-protocol", "tcp", "--transfer-heartbeat-interval-s", "0.5"])
    config = config_from_args(TransferConfig, args, "SPLITSERVE",
                              environ={"SPLITSERVE_BOOTSTRAP_PORT": "9000", "SPLITSERVE_TRANSFER_THREADS": "3"})
    assert (config.transfer_heartbeat_interval_s, config.bootstrap_port, config.transfer_threads) == (0.5, 9000, 3)
    assert config.heartbeat_timeout_s == 0.5 * config.transfer_heartbeat_misses
    with pytest.raises(SystemExit):
        parser.parse_args(["--transfer-protocol", "udp"])


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        TransferConfig(transfer_timeout_s=0)
    with pytest.raises(ValueError, match="rdma, tcp or cuda_ipc"):
        TransferConfig(transfer_protocol="ib")


@pytest.mark.skipif(bool(rdma_devices()), reason="this machine has RDMA devices")
def test_rdma_without_a_device_fails_loudly_instead_of_falling_back():
    with pytest.raises(RdmaUnavailableError, match="--transfer-protocol tcp"):
        MooncakeEngine("127.0.0.1", "rdma")
