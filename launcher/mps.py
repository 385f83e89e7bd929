"""CUDA MPS for the engines of one GPU: `splitserve up` runs one MPS control daemon for them.

Without MPS the GPU time-slices between processes: a prefill engine's prompt step waits behind the decode
engine's steps (and the other way round), so a split deployment on one GPU pays for both roles' work on every
request. Under MPS the processes' kernels run side by side on the SMs, as streams of one process would; prefill
is compute-bound and decode is memory-bound, so they overlap well.

The daemon is private to the deployment (its own pipe directory), started before the engines and quit after
they stop. Only engines of one rank that share a GPU become its clients: a GPU alone gains nothing, and engines
of several ranks keep their own contexts (NCCL's ranks each own a GPU; MPS gives them nothing to share).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MPS_MODES = ("off", "on", "auto")
CONTROL_BINARY = "nvidia-cuda-mps-control"
# A client's first kernel, run before any engine starts: CUDA initialises through the daemon, which starts its
# server; the probe exits and the server stays for the engines.
PROBE = "import sys, torch; x = torch.ones(1, device=sys.argv[1]); x.add_(1); torch.cuda.synchronize(); print(x.item())"


class MpsError(RuntimeError):
    """MPS was asked for (--mps on) and cannot run here."""


def shared_gpus(engines: list[list[str]]) -> list[str]:
    """The GPUs that two or more single-rank engines run on, given each engine's devices (one per rank), in
    order of first use. Engines of several ranks are not counted."""
    counts: dict[str, int] = {}
    for devices in engines:
        if len(devices) == 1 and devices[0].startswith("cuda"):
            counts[devices[0]] = counts.get(devices[0], 0) + 1
    return [gpu for gpu, n in counts.items() if n > 1]


@dataclass
class MpsDaemon:
    """A running MPS control daemon: the environment its clients need, and how to quit it."""

    directory: Path
    binary: str
    gpus: list[str]

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to be the daemon's client (or to command it)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log")}

    def command(self, line: str, timeout_s: float = 10.0) -> str:
        """Sends one command (e.g. `get_server_list`) to the daemon; returns its answer."""
        done = subprocess.run([self.binary], input=line + "\n", capture_output=True, text=True, timeout=timeout_s,
                              env=_with(self.env))
        if done.returncode != 0:
            raise MpsError(f"{self.binary} refused {line!r} (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()

    def server_pids(self) -> list[int]:
        """The daemon's servers (one starts when the first client attaches)."""
        return [int(word) for word in self.command("get_server_list").split() if word.isdigit()]

    def stop(self) -> None:
        """Quits the daemon (after its clients stopped) and removes its directory; a daemon that does not quit is
        logged with its pipe directory, since only a `quit` sent there stops it."""
        try:
            self.command("quit", timeout_s=20.0)
        except (MpsError, subprocess.TimeoutExpired, OSError) as exc:
            logger.warning("the MPS daemon (%s) did not quit: %s", self.env["CUDA_MPS_PIPE_DIRECTORY"], exc)
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        logger.info("MPS daemon stopped")


def _with(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}


def start_mps(mode: str, gpus: list[str], binary: str = CONTROL_BINARY,
              probe_timeout_s: float = 120.0) -> MpsDaemon | None:
    """Starts a daemon for the engines of `gpus` (shared_gpus' answer) and checks that a client attaches.

    `off`: nothing. `auto`: a daemon where a GPU is shared; where MPS cannot run, a warning says why and the
    engines time-slice the GPU as before. `on`: the same, but a GPU must be shared and a failure is an MpsError.
    """
    if mode not in MPS_MODES:
        raise ValueError(f"--mps must be one of {', '.join(MPS_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if not gpus:
        if mode == "on":
            raise MpsError("--mps on: no GPU is shared by two or more single-rank engines (MPS serves engines "
                           "that share a GPU; use --device cuda:N to put them on one)")
        return None
    path = shutil.which(binary)
    if path is None:
        return _refuse(mode, f"{binary} is not on PATH (it comes with the NVIDIA driver's utilities)")
    directory = Path(tempfile.mkdtemp(prefix="splitserve-mps-"))
    daemon = MpsDaemon(directory, path, gpus)
    for sub in ("pipe", "log"):
        (directory / sub).mkdir()
    started = subprocess.run([path, "-d"], capture_output=True, text=True, timeout=30, env=_with(daemon.env))
    if started.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        return _refuse(mode, f"{binary} -d exited with {started.returncode}: "
                             f"{(started.stderr or started.stdout).strip()}")
    why = _probe(daemon, probe_timeout_s)
    if why:
        daemon.stop()
        return _refuse(mode, why)
    logger.info("MPS on %s: the engines there share the GPU through one server (pipe directory %s)",
                ", ".join(gpus), daemon.env["CUDA_MPS_PIPE_DIRECTORY"])
    return daemon


def _probe(daemon: MpsDaemon, timeout_s: float) -> str:
    """Runs one client kernel on each shared GPU through the daemon; returns why it failed ('' when it ran and a
    server is listed)."""
    for gpu in daemon.gpus:
        try:
            done = subprocess.run([sys.executable, "-P", "-c", PROBE, gpu], capture_output=True, text=True,
                                  timeout=timeout_s, env=_with(daemon.env))
        except subprocess.TimeoutExpired:
            return f"a client on {gpu} did not start within {timeout_s:.0f} s"
        if done.returncode != 0 or done.stdout.strip() != "2.0":
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"a client on {gpu} failed through the daemon: {tail[0]}"
    try:
        if not daemon.server_pids():
            return "a client ran but the daemon lists no server (the client did not go through MPS)"
    except (MpsError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return ""


def _refuse(mode: str, why: str) -> None:
    if mode == "on":
        raise MpsError(f"--mps on: {why}")
    logger.warning("MPS is off: %s; the engines that share a GPU time-slice it (--mps off silences this)", why)
    return None
