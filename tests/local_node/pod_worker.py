"""One pod on the local node: its containers as processes, their probes, restarts and status."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pathlib
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from local_node.pod_env import EnvError, ObjectLookup, container_argv, container_env
from local_node.pod_volumes import mount_script, namespaced_argv, sync_volumes, working_dir
from local_node.probes import ProbeState, new_probe, probe_once

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
# How often ConfigMap and Secret volumes are refreshed from their objects while a pod runs.
VOLUME_SYNC_S = 1.0
MAX_BACKOFF_S = 300.0


def rfc3339(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if at is None else at))


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it goes (a crashed test run)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_process(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM to the process group, SIGKILL after ``grace_s``; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            log.info("pid %d still running after %.0fs: SIGKILL", proc.pid, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (children of the container)
    return proc.wait()


@dataclass
class PodContext:
    """What a pod's containers need from the node."""

    pod_ip: str
    host_ip: str
    folder: pathlib.Path
    lookup: ObjectLookup
    base_env: Mapping[str, str]
    entrypoints: Mapping[str, list[str]]
    known_images: frozenset[str]
    restart_backoff_s: float
    hosts_file: pathlib.Path | None = None  # the node's, bind-mounted over /etc/hosts (pod_dns.py)


@dataclass
class ContainerRun:
    """One container: its process across restarts, its probes and its status."""

    spec: Mapping[str, Any]
    restart_policy: str
    proc: subprocess.Popen | None = None
    restart_count: int = 0
    next_start_at: float = 0.0
    started_at: float = 0.0
    waiting: tuple[str, str] = ("ContainerCreating", "")
    last_exit: dict[str, Any] | None = None
    probes: dict[str, ProbeState | None] = field(default_factory=dict)
    ready: bool = False
    done: bool = False  # exited and not to be restarted (restartPolicy)
    restart_backoff_s: float = 10.0

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def started(self) -> bool:
        """Started, as the kubelet says it: running, and the startup probe (if any) passed."""
        startup = self.probes.get("startup")
        return self.running and (startup is None or startup.passing is True)

    def start(self, pod: Mapping[str, Any], ctx: PodContext, folders: Mapping[str, pathlib.Path]) -> None:
        if self.spec.get("image") not in ctx.known_images:
            self.waiting = ("ErrImagePull", f"image {self.spec.get('image')!r} is not known to the local node")
            self.next_start_at = time.monotonic() + 5.0
            return
        try:
            env = container_env(pod, self.spec, ctx.lookup, ctx.pod_ip, ctx.host_ip, ctx.base_env)
            argv = container_argv(self.spec, env, ctx.entrypoints)
            script = mount_script(self.spec, folders, ctx.folder)
            if ctx.hosts_file is not None:
                script += f"\nmount --bind {shlex.quote(str(ctx.hosts_file))} /etc/hosts"
            script += f"\ncd {working_dir(self.spec)}"
        except EnvError as exc:
            self.waiting = ("CreateContainerConfigError", str(exc))
            self.next_start_at = time.monotonic() + 1.0
            return
        logfile = open(ctx.folder / f"{self.name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        logfile.write(f"--- start {self.restart_count}: {argv}\n".encode())
        logfile.flush()
        self.proc = subprocess.Popen(namespaced_argv(script, argv), env=env, stdout=logfile,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)
        logfile.close()
        self.started_at = time.monotonic()
        self.probes = {kind: new_probe(self.spec, kind, self.started_at) for kind in ("startup", "readiness",
                                                                                       "liveness")}
        self.ready = False
        log.info("pod %s/%s container %s: pid %d on %s", pod["metadata"]["namespace"], pod["metadata"]["name"],
                 self.name, self.proc.pid, ctx.pod_ip)

    def backoff(self, base_s: float) -> float:
        """Delay before the next restart: none for the first, then base, 2x base, ... up to 5 minutes."""
        if self.restart_count == 0:
            return 0.0
        return min(base_s * 2 ** (self.restart_count - 1), MAX_BACKOFF_S)

    def on_exit(self, reason: str = "") -> None:
        """Records an exit; schedules the restart that the pod's restart policy asks for."""
        assert self.proc is not None
        code = self.proc.wait()
        self.last_exit = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                          "startedAt": rfc3339(time.time() - (time.monotonic() - self.started_at)),
                          "finishedAt": rfc3339()}
        self.proc, self.ready = None, False
        if self.restart_policy == "Never" or (self.restart_policy == "OnFailure" and code == 0):
            self.done = True
            return
        self.next_start_at = time.monotonic() + self.backoff(self.restart_backoff_s)
        self.restart_count += 1
        self.waiting = ("CrashLoopBackOff", f"back-off restarting after exit code {code}")

    def step(self, pod: Mapping[str, Any], ctx: PodContext, folders: Mapping[str, pathlib.Path],
             grace_s: float) -> None:
        """Starts, probes or restarts the container as due now."""
        now = time.monotonic()
        if self.done:
            return
        if self.proc is not None and self.proc.poll() is not None:
            self.on_exit()
        if self.proc is None:
            if now >= self.next_start_at:
                self.start(pod, ctx, folders)
            return
        startup = self.probes.get("startup")
        if startup is not None and startup.passing is not True:
            if startup.due(now):
                startup.record(self._probe(startup, ctx), now)
                if startup.passing is False:
                    self._kill_unhealthy(grace_s, "startup")
            return
        readiness, liveness = self.probes.get("readiness"), self.probes.get("liveness")
        if readiness is not None and readiness.due(now):
            readiness.record(self._probe(readiness, ctx), now)
        self.ready = readiness is None or readiness.passing is True
        if liveness is not None and liveness.due(now):
            liveness.record(self._probe(liveness, ctx), now)
            if liveness.passing is False:
                self._kill_unhealthy(grace_s, "liveness")

    def _probe(self, probe: ProbeState, ctx: PodContext) -> bool:
        return probe_once(probe.spec, self.spec, ctx.pod_ip, ctx.base_env)

    def _kill_unhealthy(self, grace_s: float, kind: str) -> None:
        assert self.proc is not None
        log.info("container %s failed its %s probe: restarting it", self.name, kind)
        stop_process(self.proc, grace_s)
        self.on_exit(reason=f"{kind.capitalize()}ProbeFailed")

    def status(self) -> dict[str, Any]:
        """The container's ContainerStatus."""
        started_at = rfc3339(time.time() - (time.monotonic() - self.started_at))
        if self.running:
            state: dict[str, Any] = {"running": {"startedAt": started_at}}
        elif self.done and self.last_exit:
            state = {"terminated": self.last_exit}
        else:
            message = {"message": self.waiting[1]} if self.waiting[1] else {}
            state = {"waiting": {"reason": self.waiting[0], **message}}
        status = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "", "ready": self.ready,
                  "started": self.started, "restartCount": self.restart_count, "state": state,
                  "lastState": {"terminated": self.last_exit} if self.last_exit else {}}
        if self.proc is not None:
            status["containerID"] = f"local://{self.proc.pid}"
        return status


class PodWorker(threading.Thread):
    """Runs one pod until it is deleted: containers, probes, volumes and the status written back."""

    def __init__(self, pod: Mapping[str, Any], ctx: PodContext, write_status: Callable[[Mapping, dict], None],
                 finish_deletion: Callable[[Mapping, bool], None]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.pod, self.ctx = pod, ctx
        self.write_status, self.finish_deletion = write_status, finish_deletion
        self.changed = threading.Event()
        self.gone = False  # the pod object was removed from the API (force-deleted)
        policy = pod["spec"].get("restartPolicy", "Always")
        self.containers = [ContainerRun(c, policy, restart_backoff_s=ctx.restart_backoff_s)
                           for c in pod["spec"]["containers"]]
        self.start_time = rfc3339()
        self.transitions: dict[str, tuple[str, str]] = {}
        self.written: dict[str, Any] | None = None

    def update(self, pod: Mapping[str, Any], gone: bool = False) -> None:
        """A newer version of the pod (or its removal) from the node's watch."""
        self.pod, self.gone = pod, self.gone or gone
        self.changed.set()

    def pid(self, container: str | None = None) -> int | None:
        """The process id of a running container (the first one when unnamed)."""
        for run in self.containers:
            if (container is None or run.name == container) and run.running:
                return run.proc.pid  # type: ignore[union-attr]
        return None

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            log.exception("pod worker %s crashed", self.name)
            self._stop_containers(0.0)

    def _run(self) -> None:
        folders: dict[str, pathlib.Path] = {}
        synced_at = 0.0
        while True:
            meta = self.pod["metadata"]
            if self.gone or meta.get("deletionTimestamp"):
                grace = 2.0 if self.gone else float(meta.get("deletionGracePeriodSeconds") or 0)
                self._stop_containers(grace)
                self.finish_deletion(self.pod, not self.gone)
                return
            if time.monotonic() - synced_at >= VOLUME_SYNC_S:
                try:
                    folders = sync_volumes(self.pod, self.ctx.folder, self.ctx.lookup)
                except EnvError as exc:
                    for run in self.containers:
                        run.waiting = ("CreateContainerConfigError", str(exc))
                synced_at = time.monotonic()
            grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            if len(folders) == len(self.pod["spec"].get("volumes") or []):
                for run in self.containers:
                    run.step(self.pod, self.ctx, folders, grace)
            status = self._status()
            if status != self.written:
                self.write_status(self.pod, status)
                self.written = status
            self.changed.wait(0.2)
            self.changed.clear()

    def _stop_containers(self, grace_s: float) -> None:
        for run in self.containers:
            if run.proc is not None:
                code = stop_process(run.proc, grace_s)
                log.info("container %s of %s exited with %s", run.name, self.name, code)
                run.proc = None

    def _condition(self, kind: str, ok: bool) -> dict[str, Any]:
        value = "True" if ok else "False"
        if self.transitions.get(kind, ("", ""))[0] != value:
            self.transitions[kind] = (value, rfc3339())
        return {"type": kind, "status": value, "lastTransitionTime": self.transitions[kind][1]}

    def _status(self) -> dict[str, Any]:
        ready = all(run.ready for run in self.containers)
        phase = "Running" if any(run.running or run.restart_count for run in self.containers) else "Pending"
        if all(run.done for run in self.containers):
            phase = "Succeeded" if all(r.last_exit and r.last_exit["exitCode"] == 0 for r in self.containers) \
                else "Failed"
        return {
            "phase": phase,
            "conditions": [self._condition("Initialized", True), self._condition("Ready", ready),
                           self._condition("ContainersReady", ready), self._condition("PodScheduled", True)],
            "hostIP": self.ctx.host_ip, "podIP": self.ctx.pod_ip, "podIPs": [{"ip": self.ctx.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [run.status() for run in self.containers],
        }
