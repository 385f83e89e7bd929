"""`up --mps`: which engines share a GPU through one MPS daemon, and what happens where MPS cannot run.

The daemon itself needs a GPU and the driver's nvidia-cuda-mps-control (tests/launcher/test_mps_gpu.py). Here:
the choice of GPUs, `off` touching nothing, `on` refusing with the reason, `auto` warning and going on, an outer
MPS daemon left in charge, and the daemon's life under `up` with a script standing in for the driver's control
program (this machine has none): started as a supervised child, probed, quit when the probe fails, its
directory removed.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from splitserve.launcher.mps import MpsError, plan_mps, shared_gpus
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


def test_off_plans_nothing_and_a_bad_mode_is_refused(tmp_path):
    assert plan_mps("off", ["cuda:0"], binary=str(tmp_path / "never-run")) is None
    with pytest.raises(ValueError, match="--mps must be one of off, on, auto"):
        plan_mps("always", ["cuda:0"])
    with pytest.raises(ValueError, match="--mps must be one of"):
        UpConfig(mps="yes")


def test_on_refuses_with_the_reason_and_auto_warns_and_goes_on(caplog, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with pytest.raises(MpsError, match="no GPU is shared by two or more single-rank engines"):
        plan_mps("on", [])
    assert plan_mps("auto", []) is None  # nothing shared: nothing to say
    missing = "splitserve-no-such-mps-control"
    with pytest.raises(MpsError, match=f"{missing} is not on PATH"):
        plan_mps("on", ["cuda:0"], binary=missing)
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.mps"):
        assert plan_mps("auto", ["cuda:0"], binary=missing) is None
    assert any("MPS is off" in r.message and missing in r.message for r in caplog.records)


def test_an_outer_mps_daemon_stays_in_charge(monkeypatch, tmp_path):
    """`up` run as an MPS client already (a device plugin's MPS sharing): its engines inherit that daemon."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert plan_mps("on", ["cuda:0"], binary=str(_stand_in(tmp_path))) is None


def _stand_in(tmp_path: Path) -> Path:
    """A control program that behaves as the driver's does in the foreground (`-f`: opens the control socket in
    $CUDA_MPS_PIPE_DIRECTORY and runs until told to quit) and logs every command it is sent."""
    script = tmp_path / "mps-control"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "-f" ]; then
    echo "Starting control daemon (on stdout, as the driver's does)"
    echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"
    while :; do sleep 0.05; done
fi
read line
echo "$line" >> "{tmp_path}/commands.log"
[ "$line" = "quit" ] && kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")"
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_daemon_whose_probe_fails_is_quit_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    """The probe's kernel cannot run here (no GPU): `on` says so, `auto` warns; either way the daemon was sent
    `quit`, exited, and its pipe directory is gone, and no engine started."""
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr("splitserve.launcher.mps.CONTROL_BINARY", str(_stand_in(tmp_path)))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    for mode in ("on", "auto"):
        deployment = Deployment(UpConfig(model="tiny", device="cuda:0", prefill=1, decode=1, mps=mode))
        monkeypatch.setattr(deployment, "_drafter", lambda _i: pytest.fail("an engine started"))
        monkeypatch.setattr(deployment, "_engine", lambda *_a, **_k: pytest.fail("an engine started"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="splitserve.launcher.mps"):
            if mode == "on":
                with pytest.raises(MpsError, match="--mps on: a client on cuda:0 failed through the daemon"):
                    deployment.start()
            else:
                deployment._start_mps()
                assert deployment.mps is None and any("MPS is off: a client on cuda:0" in r.message
                                                      for r in caplog.records)
        assert deployment.children == []
        assert list((tmp_path / "tmp").iterdir()) == []
    assert (tmp_path / "commands.log").read_text().split("\n")[:-1] == ["quit", "quit"]


def test_up_with_mps_on_and_no_shared_gpu_stops_before_any_engine_starts(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    deployment = Deployment(UpConfig(model="tiny", device="cpu", prefill=1, decode=1, mps="on"))
    with pytest.raises(MpsError, match="no GPU is shared"):
        deployment.start()
    assert deployment.children == []


def test_engines_that_did_not_attach_to_the_daemon_are_an_error_under_on_and_a_warning_under_auto(
        tmp_path, monkeypatch, caplog):
    """A process that cannot reach the daemon runs without MPS and says nothing: `up` counts the daemon's
    clients once the engines are healthy (here the daemon lists none)."""
    from splitserve.launcher.mps import MpsDaemon
    from splitserve.launcher.up import Child

    daemon = MpsDaemon(tmp_path / "mps", str(_stand_in(tmp_path)), ["cuda:0"])
    (tmp_path / "mps" / "pipe").mkdir(parents=True)
    for mode in ("on", "auto"):
        deployment = Deployment(UpConfig(model="tiny", device="cuda:0", mps=mode))
        deployment.mps = daemon
        deployment.children = [Child(f"{role}-0", "http://127.0.0.1:1", [], env=daemon.env)
                               for role in ("prefill", "decode")]
        caplog.clear()
        if mode == "on":
            with pytest.raises(MpsError, match="0 of the 2 engines given the MPS daemon are its clients"):
                deployment._check_mps_clients()
        else:
            with caplog.at_level(logging.WARNING, logger="splitserve.launcher.up"):
                deployment._check_mps_clients()
            assert any("0 of the 2 engines" in r.message for r in caplog.records)
    assert "get_server_list" in (tmp_path / "commands.log").read_text()


def test_an_engine_is_restarted_only_once_its_mps_daemon_runs_again(tmp_path, monkeypatch):
    """Started while the daemon is down, an engine would run time-sliced for good, saying nothing: `up` holds its
    restart until the daemon has been restarted and opened its control socket."""
    from splitserve.launcher.mps import MpsDaemon
    from splitserve.launcher.up import Child

    daemon = MpsDaemon(tmp_path / "mps", str(_stand_in(tmp_path)), ["cuda:0"])
    (tmp_path / "mps" / "pipe").mkdir(parents=True)
    deployment = Deployment(UpConfig(model="tiny", device="cuda:0", restart_backoff_s=0.05))
    deployment.mps = daemon
    (tmp_path / "mps" / "log").mkdir()
    control = Child("mps-control", "", [], ready_path=None, command=daemon.command, env=daemon.env,
                    log=daemon.log_file)
    engine = Child("decode-0", "http://127.0.0.1:1", [], command=["sleep", "60"], env=daemon.env)
    deployment.children, deployment._mps_child = [control, engine], control
    try:
        for child in (control, engine):
            deployment._spawn(child)
        assert daemon.wait_ready(control.proc) == ""
        first_engine = engine.proc
        daemon.send("quit")  # the daemon exits; so do its clients
        control.proc.wait(timeout=10)
        engine.proc.kill()
        engine.proc.wait()
        (tmp_path / "mps" / "pipe" / "control").unlink()
        deployment.supervise_once()  # both seen down, each with its backoff
        assert control.restart_at is not None and engine.restart_at is not None
        engine.restart_at = control.restart_at = 0.0  # both due now
        control.restart_at = float("inf")  # ... but the daemon's restart waits longer
        deployment.supervise_once()
        assert engine.proc is first_engine and engine.restart_at == 0.0  # held back
        control.restart_at = 0.0
        deployment.supervise_once()  # the daemon restarts
        assert daemon.wait_ready(control.proc) == ""
        deployment.supervise_once()
        assert engine.proc is not first_engine and engine.proc.poll() is None  # now the engine
        # The daemon logs to stdout in the foreground: into its log, never into up's stdout (its endpoint line).
        assert daemon.log_file.read_text().count("Starting control daemon") == 2
    finally:
        for child in (engine, control):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()


def test_sm_caps_are_read_per_role_and_bad_ones_are_refused():
    from splitserve.launcher.mps import parse_sm_percents

    assert parse_sm_percents("") == {}
    assert parse_sm_percents("decode=40") == {"decode": 40}
    assert parse_sm_percents(" prefill=100, decode=35 ") == {"prefill": 100, "decode": 35}
    for spec, why in [("decode", "not ROLE=PERCENT"), ("router=50", "not ROLE=PERCENT"),
                      ("decode=0", "1 to 100"), ("decode=101", "1 to 100"), ("decode=4.5", "whole number"),
                      ("decode=40,decode=50", "decode is given twice")]:
        with pytest.raises(ValueError, match=why):
            parse_sm_percents(spec)
    with pytest.raises(ValueError, match="no effect with --mps off"):
        UpConfig(mps="off", mps_sm_percent="decode=40")
    with pytest.raises(ValueError, match="not ROLE=PERCENT"):
        UpConfig(mps_sm_percent="decode:40")


def test_low_priority_roles_are_read_and_bad_ones_are_refused():
    from splitserve.launcher.mps import parse_low_priority

    assert parse_low_priority("") == parse_low_priority("none") == []
    assert parse_low_priority("auto") == ["decode"]  # the default
    assert parse_low_priority(" decode , drafter") == ["decode", "drafter"]
    for spec, why in [("router", "not a role"), ("decode=1", "not a role"), ("decode,decode", "given twice")]:
        with pytest.raises(ValueError, match=why):
            parse_low_priority(spec)
    with pytest.raises(ValueError, match="no effect with --mps off"):
        UpConfig(mps="off", mps_low_priority="decode")
    UpConfig(mps="off")  # the default (auto) goes with any --mps


def test_a_low_priority_role_runs_below_normal_and_the_others_at_normal(tmp_path, monkeypatch, caplog):
    """The priority is the client's CUDA_MPS_CLIENT_PRIORITY (1: below normal), set only on the named role's
    engines, beside a cap where both are given; without a daemon of the deployment `up` says it has no effect."""
    from splitserve.launcher.mps import PRIORITY_ENV, SM_PERCENT_ENV, MpsDaemon

    monkeypatch.delenv("SPLITSERVE_TP_SIZE", raising=False)
    deployment = Deployment(UpConfig(model="tiny", device="cuda:0", mps_low_priority="decode",
                                     mps_sm_percent="prefill=90"))
    deployment.mps = MpsDaemon(tmp_path / "mps", "never-run", ["cuda:0"])
    monkeypatch.setattr(deployment, "_spawn", lambda child: None)
    deployment._engine("prefill", 0)
    deployment._engine("decode", 0)
    prefill, decode = deployment.children
    assert PRIORITY_ENV not in prefill.env and decode.env[PRIORITY_ENV] == "1"
    assert prefill.env[SM_PERCENT_ENV] == "90" and SM_PERCENT_ENV not in decode.env
    by_default = Deployment(UpConfig(model="tiny", device="cuda:0"))
    by_default.mps = deployment.mps
    monkeypatch.setattr(by_default, "_spawn", lambda child: None)
    by_default._engine("prefill", 0)
    by_default._engine("decode", 0)
    assert [PRIORITY_ENV in c.env for c in by_default.children] == [False, True]
    plain = Deployment(UpConfig(model="tiny", device="cuda:0", mps_low_priority="none"))
    plain.mps = deployment.mps
    monkeypatch.setattr(plain, "_spawn", lambda child: None)
    plain._engine("decode", 0)
    assert PRIORITY_ENV not in plain.children[0].env

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    alone = Deployment(UpConfig(model="tiny", device="cpu", mps="auto", mps_low_priority="decode"))
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.up"):
        alone._start_mps()
    assert any("--mps-low-priority decode has no effect" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.up"):
        Deployment(UpConfig(model="tiny", device="cpu", mps="auto"))._start_mps()
    assert not any("--mps-low-priority" in r.message for r in caplog.records)  # the default says nothing


def test_a_capped_role_gets_its_sm_share_through_the_daemon_and_the_others_every_sm(tmp_path, monkeypatch, caplog):
    """The cap is the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set only on the named role's engines; where no
    daemon of the deployment runs, `up` says the cap has no effect."""
    from splitserve.launcher.mps import PIPE_ENV, SM_PERCENT_ENV, MpsDaemon

    monkeypatch.delenv("SPLITSERVE_TP_SIZE", raising=False)
    deployment = Deployment(UpConfig(model="tiny", device="cuda:0", mps_sm_percent="decode=40"))
    deployment.mps = MpsDaemon(tmp_path / "mps", "never-run", ["cuda:0"])
    monkeypatch.setattr(deployment, "_spawn", lambda child: None)
    deployment._engine("prefill", 0)
    deployment._engine("decode", 0)
    prefill, decode = deployment.children
    assert prefill.env[PIPE_ENV] == decode.env[PIPE_ENV] == str(tmp_path / "mps" / "pipe")
    assert SM_PERCENT_ENV not in prefill.env and decode.env[SM_PERCENT_ENV] == "40"

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    uncapped = Deployment(UpConfig(model="tiny", device="cpu", mps="auto", mps_sm_percent="decode=40"))
    with caplog.at_level(logging.WARNING, logger="splitserve.launcher.up"):
        uncapped._start_mps()
    assert any("--mps-sm-percent decode=40 has no effect" in r.message for r in caplog.records)
