"""`up --mps`: which engines share a GPU through one MPS daemon, and what happens where MPS cannot run.

The daemon itself needs a GPU and the driver's nvidia-cuda-mps-control (tests/launcher/test_mps_gpu.py). Here:
the choice of GPUs, `off` touching nothing, `on` refusing with the reason, `auto` warning and going on, and a
control program that fails (a script standing in for the driver's binary, which this machine lacks).
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from splitserve.launcher.mps import MpsError, shared_gpus, start_mps
from splitserve.launcher.up import Deployment, UpConfig


def test_mps_serves_gpus_that_two_single_rank_engines_share():
    assert shared_gpus([["cuda:0"], ["cuda:0"]]) == ["cuda:0"]
    assert shared_gpus([["cuda:1"], ["cuda:0"], ["cuda:1"], ["cuda:0"], ["cuda:2"]]) == ["cuda:1", "cuda:0"]
    assert shared_gpus([["cuda:0"], ["cuda:1"]]) == []
    assert shared_gpus([["cpu"], ["cpu"]]) == []
    # Engines of several ranks are not MPS clients, so they make no GPU shared.
    assert shared_gpus([["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]]) == []
    assert shared_gpus([["cuda:0", "cuda:1"], ["cuda:0"]]) == []


@pytest.mark.parametrize("args,want", [
    ({"prefill": 1, "decode": 1}, ["cuda:0"]),
    ({"prefill": 1, "decode": 1, "encode": 1, "drafter": 1}, ["cuda:0"]),
    ({"unified": 1}, []),
    ({"unified": 2, "engine_args": "--tp-size 2"}, []),
])
def test_up_asks_for_mps_where_its_engines_share_a_gpu(args, want, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_TP_SIZE", raising=False)
    assert shared_gpus(Deployment(UpConfig(model="tiny", device="cuda:0", **args))._engine_devices()) == want


def test_off_starts_nothing_and_a_bad_mode_is_refused(tmp_path):
    assert start_mps("off", ["cuda:0"], binary=str(tmp_path / "never-run")) is None
    with pytest.raises(ValueError, match="--mps must be one of off, on, auto"):
        start_mps("always", ["cuda:0"])
    with pytest.raises(ValueError, match="--mps must be one of"):
        UpConfig(mps="yes")


def test_on_refuses_with_the_reason_and_auto_warns_and_goes_on(caplog):
    with pytest.raises(MpsError, match="no GPU is shared by two or more single-rank engines"):
        start_mps("on", [])
    assert start_mps("auto", []) is None  # nothing shared: nothing to say
    missing = "splitserve-no-such-mps-control"
    with pytest.raises(MpsError, match=f"{missing} is not on PATH"):
        start_mps("on", ["cuda:0"], binary=missing)
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.mps"):
        assert start_mps("auto", ["cuda:0"], binary=missing) is None
    assert any("MPS is off" in r.message and missing in r.message for r in caplog.records)


def _failing_control(tmp_path: Path) -> Path:
    script = tmp_path / "mps-control"
    script.write_text("#!/bin/sh\necho 'cannot open /dev/nvidiactl' >&2\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_daemon_that_does_not_start_is_reported_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    control = _failing_control(tmp_path)
    with pytest.raises(MpsError, match="exited with 3: cannot open /dev/nvidiactl"):
        start_mps("on", ["cuda:0"], binary=str(control))
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.mps"):
        assert start_mps("auto", ["cuda:0"], binary=str(control)) is None
    assert any("cannot open /dev/nvidiactl" in r.message for r in caplog.records)
    assert list((tmp_path / "tmp").iterdir()) == []  # its pipe directories are gone


def test_up_with_mps_on_and_no_shared_gpu_stops_before_any_engine_starts():
    deployment = Deployment(UpConfig(model="tiny", device="cpu", prefill=1, decode=1, mps="on"))
    with pytest.raises(MpsError, match="no GPU is shared"):
        deployment.start()
    assert deployment.children == []
