"""CUDA MPS for the engines of one GPU: `splitserve up` runs one MPS control daemon for them.

Without MPS the GPU time-slices between processes: a prefill engine's prompt step waits behind the decode
engine's steps (and the other way round), so a split deployment on one GPU pays for both roles' work on every
request. Under MPS the processes' kernels run side by side on the SMs, as streams of one process would; prefill
is compute-bound and decode is memory-bound, so they overlap. The price is isolation: a fatal GPU fault in one
client ends every client of the GPU (`up` then restarts them all), and a prefill step can take SMs a decode step
would have had. `--mps-sm-percent decode=40` caps the SMs one role's engines may use
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of that client); a decode step needs few SMs to read the weights at full memory
bandwidth, so capping it leaves the rest to the prompt steps. Under a cap cuBLAS computes some shapes wrong, so a
capped engine runs its projections through checked algorithms (engine/layers/sm_cap_gemms.py).

The decode's clients also run below normal priority (`--mps-low-priority`, by default the decode:
CUDA_MPS_CLIENT_PRIORITY=1): the server hands free SMs to the other clients' waiting blocks first, so a prompt step
is slowed less by the decode beside it, and the decode has every SM when no prompt step runs. A cap is fixed when
its process starts; a priority follows the load.

The daemon is private to the deployment (its own pipe directory) and runs in the foreground as one of `up`'s
supervised processes: started before the engines, checked by a probe kernel, quit after the engines stop, and
restarted like any other process if it exits. Only engines of one rank that share a GPU become its clients: a GPU
alone gains nothing, and engines of several ranks keep their own contexts (NCCL's ranks each own a GPU).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MPS_MODES = ("off", "on", "auto")
CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
BELOW_NORMAL = "1"  # CUDA_MPS_CLIENT_PRIORITY's values: 0 normal (the default), 1 below normal
CAPPABLE_ROLES = ("unified", "prefill", "decode", "encode", "drafter")  # engine/config.py's ROLES (it imports torch)
# A client's first kernel, run before any engine starts: CUDA initialises through the daemon, which starts its
# server; the probe exits and the server stays for the engines.
PROBE = "import sys, torch; x = torch.ones(1, device=sys.argv[1]); x.add_(1); torch.cuda.synchronize(); print(x.item())"


class MpsError(RuntimeError):
    """MPS was asked for (--mps on) and cannot run here."""


def parse_sm_percents(spec: str) -> dict[str, int]:
    """`--mps-sm-percent`'s ROLE=PERCENT[,ROLE=PERCENT...] (e.g. "decode=40") as {role: percent}; '' gives {}."""
    caps: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        role, sep, value = item.partition("=")
        role = role.strip()
        if not sep or role not in CAPPABLE_ROLES:
            raise ValueError(f"--mps-sm-percent: {item!r} is not ROLE=PERCENT with ROLE one of "
                             f"{', '.join(CAPPABLE_ROLES)} (e.g. decode=40)")
        try:
            percent = int(value)
        except ValueError:
            raise ValueError(f"--mps-sm-percent: {item!r}: the percentage must be a whole number") from None
        if not 1 <= percent <= 100:
            raise ValueError(f"--mps-sm-percent: {item!r}: the percentage must be 1 to 100")
        if role in caps:
            raise ValueError(f"--mps-sm-percent: {role} is given twice")
        caps[role] = percent
    return caps


LOW_PRIORITY_DEFAULT = ("decode",)  # --mps-low-priority auto: a decode step yields to prompt steps


def parse_low_priority(spec: str) -> list[str]:
    """`--mps-low-priority`'s ROLE[,ROLE...] (e.g. "decode") as a list of roles; 'auto' gives the default (the
    decode), '' or 'none' gives []."""
    if spec.strip() == "auto":
        return list(LOW_PRIORITY_DEFAULT)
    if spec.strip() == "none":
        return []
    roles: list[str] = []
    for role in filter(None, (part.strip() for part in spec.split(","))):
        if role not in CAPPABLE_ROLES:
            raise ValueError(f"--mps-low-priority: {role!r} is not a role; give auto, none or roles of "
                             f"{', '.join(CAPPABLE_ROLES)} (e.g. decode)")
        if role in roles:
            raise ValueError(f"--mps-low-priority: {role} is given twice")
        roles.append(role)
    return roles


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
    """A deployment's MPS control daemon: its pipe directory, the environment its clients need, and its
    commands. The process itself (`command`, in the foreground) is one of `up`'s supervised children."""

    directory: Path
    binary: str
    gpus: list[str]

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to be the daemon's client (or to command it)."""
        return {PIPE_ENV: str(self.directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log")}

    @property
    def command(self) -> list[str]:
        return [self.binary, "-f"]

    @property
    def control_socket(self) -> Path:
        """The daemon's socket: there once it accepts commands and clients."""
        return self.directory / "pipe" / "control"

    @property
    def log_file(self) -> Path:
        """Where the daemon's output goes: in the foreground it logs to stdout."""
        return self.directory / "log" / "control.log"

    def send(self, line: str, timeout_s: float = 10.0) -> str:
        """Sends one command (e.g. `get_server_list`) to the daemon; returns its answer."""
        done = subprocess.run([self.binary], input=line + "\n", capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **self.env})
        if done.returncode != 0:
            raise MpsError(f"{self.binary} refused {line!r} (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()

    def server_pids(self) -> list[int]:
        """The daemon's servers (one starts when the first client attaches)."""
        return [int(word) for word in self.send("get_server_list").split() if word.isdigit()]

    def client_pids(self) -> list[int]:
        """Every process attached to one of the daemon's servers."""
        return [int(word) for server in self.server_pids()
                for word in self.send(f"get_client_list {server}").split() if word.isdigit()]

    def wait_ready(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
        """Waits for the daemon's control socket; returns why it is not there ('' once it is)."""
        deadline = time.monotonic() + timeout_s
        while not self.control_socket.exists():
            if proc.poll() is not None:
                return f"{self.binary} -f exited with code {proc.returncode}{self._log_tail()}"
            if time.monotonic() > deadline:
                return f"{self.binary} -f opened no control socket within {timeout_s:.0f} s{self._log_tail()}"
            time.sleep(0.05)
        return ""

    def probe(self, timeout_s: float = 60.0) -> str:
        """Runs one client kernel on each shared GPU through the daemon; returns why it failed ('' when it ran
        and a server is listed: a client that cannot reach the daemon runs without MPS, saying nothing)."""
        for gpu in self.gpus:
            try:
                done = subprocess.run([sys.executable, "-P", "-c", PROBE, gpu], capture_output=True, text=True,
                                      timeout=timeout_s, env={**os.environ, **self.env})
            except subprocess.TimeoutExpired:
                return f"a client on {gpu} did not start within {timeout_s:.0f} s"
            if done.returncode != 0 or done.stdout.strip() != "2.0":
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                return f"a client on {gpu} failed through the daemon: {tail[0]}"
        try:
            if not self.server_pids():
                return "a client ran but the daemon lists no server (the client did not go through MPS)"
        except (MpsError, subprocess.SubprocessError, OSError) as exc:
            return str(exc)
        return ""

    def quit(self, proc: subprocess.Popen | None, timeout_s: float = 20.0) -> None:
        """Asks the daemon to quit (once its clients have stopped), waits for it, and removes its directory;
        a daemon that does not quit is terminated."""
        if proc is not None and proc.poll() is None:
            try:
                self.send("quit", timeout_s)
                proc.wait(timeout=timeout_s)
            except (MpsError, subprocess.SubprocessError, OSError) as exc:
                logger.warning("the MPS daemon did not quit (%s); terminating it", exc)
                proc.terminate()
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _log_tail(self) -> str:
        log = self.log_file
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return f": {lines[-1]}" if lines else ""


def plan_mps(mode: str, gpus: list[str], binary: str | None = None) -> MpsDaemon | None:
    """The daemon to start for the engines of `gpus` (shared_gpus' answer), its directory made; None for none.

    `off`: none. `auto`: one where a GPU is shared; where MPS cannot run, a warning says why and the engines
    time-slice the GPU as before. `on`: the same, but a GPU must be shared and a failure is an MpsError. Where
    `up` itself runs as an MPS client already (CUDA_MPS_PIPE_DIRECTORY set, e.g. by a device plugin), its
    engines inherit that and no daemon of its own is started."""
    if mode not in MPS_MODES:
        raise ValueError(f"--mps must be one of {', '.join(MPS_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if not gpus:
        if mode == "on":
            raise MpsError("--mps on: no GPU is shared by two or more single-rank engines (MPS serves engines "
                           "that share a GPU; use --device cuda:N to put them on one)")
        return None
    if os.environ.get(PIPE_ENV):
        logger.info("MPS: the engines use the daemon of %s=%s", PIPE_ENV, os.environ[PIPE_ENV])
        return None
    binary = binary or CONTROL_BINARY
    path = shutil.which(binary)
    if path is None:
        return refuse(mode, f"{binary} is not on PATH (it comes with the NVIDIA driver's utilities)")
    directory = Path(tempfile.mkdtemp(prefix="splitserve-mps-"))
    for sub in ("pipe", "log"):
        (directory / sub).mkdir()
    return MpsDaemon(directory, path, gpus)


def refuse(mode: str, why: str) -> None:
    """MPS cannot run: an MpsError under `on`, else a warning."""
    if mode == "on":
        raise MpsError(f"--mps on: {why}")
    logger.warning("MPS is off: %s; the engines that share a GPU time-slice it (--mps off silences this)", why)
    return None
