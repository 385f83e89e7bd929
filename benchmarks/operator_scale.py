"""The operator at scale: N ServingGroups (1 prefill + 2 decode each) applied at once converge, then
changes to single groups are reconciled while the rest idle.

  python3 -P benchmarks/operator_scale.py --groups 1000      # prints the figures, writes JSON

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler from
scripts/k8s_assets.sh) and the local node in its simulated mode (pods bound by the scheduler are
marked Running and Ready with an address; no process runs). The operator runs as its own
`splitserve operator` process with its default settings. Figures, each as a ratio to its target:
- convergence: from the apply until every group is Ready (every child exists, every pod Ready,
  status observed for the current generation); target 300 s;
- reconcile latency: a change to one group (spec.rollout.maxSkewPercent) until its status
  reports the new generation, over --changes samples on different groups; target p99 < 2 s;
- operator RSS after convergence (target < 300 MB) and its CPU while idle over --idle-s seconds
  (target < 5% of a core).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

import kubernetes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from envtest import ControlPlane, find_assets
from local_node import LocalNode, NodeCapacity, PodAddresses

from splitserve.operator.kube import Kube

log = logging.getLogger("operator_scale")
REPO = pathlib.Path(__file__).resolve().parents[1]
NAMESPACE = "scale"
TARGETS = {"convergence_s": 300.0, "reconcile_p99_s": 2.0, "rss_mb": 300.0, "idle_cpu_core_fraction": 0.05}


def group_yaml(i: int) -> str:
    return f"""apiVersion: splitserve.io/v1alpha1
kind: ServingGroup
metadata: {{name: g{i:04d}}}
spec:
  model: {{name: tiny, builtin: tiny}}
  roles:
    prefill: {{replicas: 1}}
    decode: {{replicas: 2}}
"""


def process_cpu_s(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def groups_state(kube: Kube) -> tuple[int, dict[str, dict]]:
    """(how many groups are Ready for their current generation, name -> group)."""
    items = kube.request("GET", f"/apis/splitserve.io/v1alpha1/namespaces/{NAMESPACE}/servinggroups")["items"]
    ready = 0
    for g in items:
        status = g.get("status") or {}
        if status.get("observedGeneration") == g["metadata"]["generation"] and any(
                c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []):
            ready += 1
    return ready, {g["metadata"]["name"]: g for g in items}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=100, help="single-group changes timed after convergence")
    parser.add_argument("--idle-s", type=float, default=60.0, help="window of the idle CPU measurement")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="give up converging after this")
    parser.add_argument("--operator-args", default="", help="more `splitserve operator` flags, e.g. "
                        "'--resync-seconds 60' to see the resync's share of the idle CPU")
    parser.add_argument("--apply-chunk", type=int, default=50, help="groups per parallel `kubectl apply`")
    parser.add_argument("--py-spy", type=pathlib.Path, default=None,
                        help="record the operator with py-spy during convergence into this flame graph (SVG)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("operator_scale.json"),
                        help="where the figures go (JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("local_node").setLevel(logging.WARNING)
    assets = find_assets()
    if assets is None:
        sys.exit("no Kubernetes binaries: run scripts/k8s_assets.sh")
    work = pathlib.Path(tempfile.mkdtemp(prefix="operator-scale-"))
    cp = ControlPlane(assets, work / "k8s", with_scheduler=True)
    node = operator = None
    try:
        cp.start(before_controllers=[REPO / "manifests" / "crds"])
        kube = Kube(kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig)), field_manager="bench")
        server = urllib.parse.urlparse(cp.server)
        pods = args.groups * 4  # prefill, 2 decode, router
        node = LocalNode(kube, "sim-0", work / "node", api_host=server.hostname, api_port=server.port,
                         capacity=NodeCapacity(cpu="100000", memory="100Ti", gpus=0, pods=pods + 100),
                         addresses=PodAddresses("10.96.0.0/12"), run_pods=False).start()
        cp.kubectl("create", "namespace", NAMESPACE)
        cp.kubectl("apply", "-f", str(REPO / "manifests" / "rbac.yaml"))  # the router ClusterRole
        operator_log = open(work / "operator.log", "wb")  # noqa: SIM115 (lives with the process)
        operator = subprocess.Popen([sys.executable, "-P", "-m", "splitserve.cli", "operator", "--kubeconfig",
                                     str(cp.kubeconfig), "--liveness-port", "0", *args.operator_args.split()],
                                    stdout=operator_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        time.sleep(3)
        processes = {**{name: proc.pid for name, proc in cp.processes.items()}, "operator": operator.pid,
                     "node (this process)": os.getpid()}
        cpu_before = {name: process_cpu_s(pid) for name, pid in processes.items()}
        spy = None
        if args.py_spy is not None:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(operator.pid), "--rate", "50", "--nonblocking",
                                    "--output", str(args.py_spy)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
        # Applied at once: kubectl's client-side rate limit (5 requests/s) made one `kubectl apply` of
        # 1,000 groups take minutes by itself, so they go in parallel chunks, one kubectl each.
        manifests = []
        for first in range(0, args.groups, args.apply_chunk):
            manifests.append(work / f"groups-{first:04d}.yaml")
            manifests[-1].write_text("---\n".join(group_yaml(i) for i in range(first, min(args.groups,
                                                                                      first + args.apply_chunk))))
        start = time.monotonic()
        appliers = [subprocess.Popen([cp.binary("kubectl"), f"--kubeconfig={cp.kubeconfig}", "apply", "-n", NAMESPACE,
                                      "-f", str(m)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    for m in manifests]
        for applier in appliers:
            _, err = applier.communicate()
            if applier.returncode:
                sys.exit(f"kubectl apply failed: {err.decode(errors='replace')}")
        applied_s = time.monotonic() - start
        log.info("applied %d groups in %.1fs", args.groups, applied_s)
        ready = 0
        while ready < args.groups:
            if operator.poll() is not None:
                sys.exit(f"the operator exited with {operator.returncode}; log in {work / 'operator.log'}")
            if time.monotonic() - start > args.timeout_s:
                sys.exit(f"not converged after {args.timeout_s}s: {ready}/{args.groups} Ready")
            time.sleep(5)
            ready, _ = groups_state(kube)
            cpu = " ".join(f"{name.split()[0]}={process_cpu_s(pid) - cpu_before[name]:.0f}"
                           for name, pid in processes.items())
            log.info("%.0fs: %d/%d groups Ready, %d simulated pods; CPU s: %s", time.monotonic() - start, ready,
                     args.groups, len(node.simulated), cpu)
        convergence_s = time.monotonic() - start
        rss_mb = process_rss_mb(operator.pid)
        # Who spent the CPU while converging: the operator, the control plane, or the simulated node.
        cpu_converging = {name: round(process_cpu_s(pid) - cpu_before[name], 1) for name, pid in processes.items()}
        log.info("CPU seconds while converging: %s", cpu_converging)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)

        time.sleep(10)  # let the last events settle
        cpu0, t0 = process_cpu_s(operator.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_cpu = (process_cpu_s(operator.pid) - cpu0) / (time.monotonic() - t0)

        latencies = []
        step = max(1, args.groups // args.changes)
        for i in range(0, args.groups, step)[: args.changes]:
            name = f"g{i:04d}"
            body = kube.request("PATCH", f"/apis/splitserve.io/v1alpha1/namespaces/{NAMESPACE}/servinggroups/{name}",
                                body={"spec": {"rollout": {"maxSkewPercent": 30}}},
                                content_type="application/merge-patch+json")
            generation, t = body["metadata"]["generation"], time.monotonic()
            while True:
                g = kube.get("splitserve.io/v1alpha1", "ServingGroup", NAMESPACE, name)
                if (g.get("status") or {}).get("observedGeneration") == generation:
                    break
                if time.monotonic() - t > 60:
                    sys.exit(f"{name}: generation {generation} not observed after 60s")
                time.sleep(0.02)
            latencies.append(time.monotonic() - t)
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        figures = {
            "groups": args.groups, "pods": len(node.simulated), "apply_s": round(applied_s, 1),
            "convergence_s": round(convergence_s, 1), "reconcile_p50_s": round(statistics.median(latencies), 3),
            "reconcile_p99_s": round(p99, 3), "rss_mb": round(rss_mb, 1),
            "idle_cpu_core_fraction": round(idle_cpu, 4), "cpus": os.cpu_count(),
            "cpu_s_while_converging": cpu_converging,
        }
        figures["ratio_to_target"] = {k: round(figures[k] / v, 3) for k, v in TARGETS.items()}
        print(json.dumps(figures, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        return 0
    finally:
        try:
            if operator is not None and operator.poll() is None:
                operator.terminate()
                try:
                    operator.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    operator.kill()
                    operator.wait()
            if node is not None:
                node.stop()
        finally:
            cp.stop()


if __name__ == "__main__":
    sys.exit(main())
