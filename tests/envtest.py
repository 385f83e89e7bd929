"""A real Kubernetes control plane on loopback for tests, like controller-runtime's envtest.

etcd, kube-apiserver (RBAC, service accounts), kube-controller-manager (garbage collector,
namespace, service-account, deployment, replicaset, statefulset and endpoints controllers)
and, on request, kube-scheduler run as child processes with their own CA, certificates and
service-account key. There is no kubelet: tests mark pods ready by patching their status, or
register a local node (tests/local_node) that runs the pods the scheduler binds to it.

The binaries come from ``$KUBEBUILDER_ASSETS`` or the cache ``scripts/k8s_assets.sh`` fills.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

K8S_VERSION = "1.20.2"
REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm")
CONTROLLERS = ("garbagecollector", "namespace", "serviceaccount", "serviceaccount-token", "deployment",
               "replicaset", "statefulset", "endpoint")
# Client rate limits of the controllers and the scheduler: their defaults (20 and 50 requests/s)
# would make thousands of pods (the operator's scale benchmark) wait on the client side.
CONTROLLER_QPS, CONTROLLER_BURST = 200, 400
# Room for the ClusterIPs of thousands of router Services (the scale benchmark); 10.0.0.1 is the
# API server's own Service, named in its certificate.
SERVICE_CIDR = "10.0.0.0/16"


class ControlPlaneError(RuntimeError):
    """A control-plane process failed to start or to become ready."""


def default_cache_dir() -> pathlib.Path:
    """Where scripts/k8s_assets.sh caches the binaries."""
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return pathlib.Path(os.environ.get("SPLITSERVE_K8S_CACHE") or cache / "splitserve" / "k8s" /
                        f"v{K8S_VERSION}") / "bin"


def missing_binaries(folder: pathlib.Path) -> list[str]:
    """The required binaries absent (or not executable) in ``folder``."""
    return [name for name in REQUIRED_BINARIES if not os.access(folder / name, os.X_OK)]


def find_assets() -> pathlib.Path | None:
    """``$KUBEBUILDER_ASSETS`` when set, else the cache folder when complete, else None."""
    if os.environ.get("KUBEBUILDER_ASSETS"):
        return pathlib.Path(os.environ["KUBEBUILDER_ASSETS"])
    folder = default_cache_dir()
    return folder if not missing_binaries(folder) else None


def free_port() -> int:
    """A TCP port nothing listens on at the moment, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
                 sans: list[x509.GeneralName] | None = None, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        usage = x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class Certificates:
    """Paths of the CA, the API server's serving pair, the admin client pair and the SA key."""

    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    admin_cert: pathlib.Path
    admin_key: pathlib.Path
    sa_key: pathlib.Path
    sa_pub: pathlib.Path


def write_certificates(folder: pathlib.Path) -> Certificates:
    """Generates a CA, a serving certificate for loopback, a system:masters client and an SA key."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitserve-envtest-ca")])
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                    x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
                                    x509.DNSName("localhost")]
    sans += [x509.DNSName(n) for n in ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                       "kubernetes.default.svc.cluster.local")]
    server = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
                          server_key, ca_name, ca_key, sans=sans, server=True)
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin = _certificate(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                                    x509.NameAttribute(NameOID.COMMON_NAME, "envtest-admin")]),
                         admin_key, ca_name, ca_key)
    sa_key = ec.generate_private_key(ec.SECP256R1())
    certs = Certificates(folder / "ca.crt", folder / "apiserver.crt", folder / "apiserver.key",
                         folder / "admin.crt", folder / "admin.key", folder / "sa.key", folder / "sa.pub")
    certs.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certs.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    certs.server_key.write_bytes(_pem_key(server_key))
    certs.admin_cert.write_bytes(admin.public_bytes(serialization.Encoding.PEM))
    certs.admin_key.write_bytes(_pem_key(admin_key))
    certs.sa_key.write_bytes(_pem_key(sa_key))
    certs.sa_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return certs


def kubeconfig_document(server: str, ca: pathlib.Path, user: dict[str, str], name: str = "envtest") -> str:
    """A kubeconfig with one cluster, one user and one current context."""
    return yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    })


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on loopback ports, in ``workdir``."""

    assets: pathlib.Path
    workdir: pathlib.Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    server: str = ""
    kubeconfig: pathlib.Path = field(default=pathlib.Path())
    certs: Certificates | None = None
    # Run kube-scheduler too (pods then get bound to the registered nodes).
    with_scheduler: bool = False

    def binary(self, name: str) -> str:
        """Path of one of the asset binaries."""
        return str(self.assets / name)

    def _spawn(self, name: str, args: list[str]) -> None:
        logfile = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the process)
        self.processes[name] = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        logfile.close()

    def log_tail(self, name: str, lines: int = 30) -> str:
        """The last lines of a component's log."""
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, timeout: float = 90.0, before_controllers: list[pathlib.Path] | None = None) -> None:
        """Starts everything and waits until the API server is ready.

        ``before_controllers``: manifests applied before kube-controller-manager starts, so
        that its garbage collector watches their kinds from the beginning (it rediscovers new
        kinds only every 30 seconds).
        """
        missing = missing_binaries(self.assets)
        if missing:
            raise ControlPlaneError(f"{self.assets} lacks {', '.join(missing)}; run scripts/k8s_assets.sh")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.certs = certs = write_certificates(self.workdir / "pki")
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        # etcd 3.4 has no --unsafe-no-fsync; tmpfs makes its fsyncs free.
        shm = pathlib.Path("/dev/shm")
        data_root = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        self.etcd_data = data_root / f"splitserve-etcd-{os.getpid()}-{etcd_port}"
        self._spawn("etcd", [
            self.binary("etcd"), "--name", "envtest", "--data-dir", str(self.etcd_data),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"envtest=http://127.0.0.1:{peer_port}",
            "--logger", "zap", "--log-level", "warn",
        ])
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("kube-apiserver", [
            self.binary("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", "--insecure-port=0",
            f"--cert-dir={self.workdir / 'apiserver'}",
            f"--tls-cert-file={certs.server_cert}", f"--tls-private-key-file={certs.server_key}",
            f"--client-ca-file={certs.ca}",
            f"--service-account-key-file={certs.sa_pub}",
            f"--service-account-signing-key-file={certs.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v=1",
        ])
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(kubeconfig_document(
            self.server, certs.ca, {"client-certificate": str(certs.admin_cert),
                                    "client-key": str(certs.admin_key)}))
        self._wait_ready(timeout)
        for manifest in before_controllers or []:
            self.kubectl("apply", "-f", str(manifest))
        self._spawn("kube-controller-manager", [
            self.binary("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={certs.sa_key}",
            f"--root-ca-file={certs.ca}",
            "--leader-elect=false", "--port=0", "--secure-port=0",
            "--concurrent-statefulset-syncs=5", "--concurrent-gc-syncs=10",
            f"--kube-api-qps={CONTROLLER_QPS}", f"--kube-api-burst={CONTROLLER_BURST}",
            "--v=1",
        ])
        if self.with_scheduler:
            self._spawn("kube-scheduler", [
                self.binary("kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false", "--port=0", "--secure-port=0",
                f"--kube-api-qps={CONTROLLER_QPS}", f"--kube-api-burst={CONTROLLER_BURST}",
                "--v=1",
            ])
        self._wait_default_service_account(timeout)

    def _check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def _wait_ready(self, timeout: float) -> None:
        assert self.certs is not None
        context = ssl.create_default_context(cafile=str(self.certs.ca))
        context.load_cert_chain(str(self.certs.admin_cert), str(self.certs.admin_key))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=context, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise ControlPlaneError(f"kube-apiserver not ready after {timeout}s ({last}):\n"
                                f"{self.log_tail('kube-apiserver')}")

    def _wait_default_service_account(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise ControlPlaneError(f"no default ServiceAccount after {timeout}s:\n"
                                f"{self.log_tail('kube-controller-manager')}")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
        """Runs kubectl against this control plane."""
        cmd = [self.binary("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise ControlPlaneError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs helm against this control plane, with its state kept in the work folder."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
               "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
               "HELM_DATA_HOME": str(self.workdir / "helm" / "data")}
        cmd = [self.binary("helm"), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        if check and result.returncode != 0:
            raise ControlPlaneError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def stop(self) -> None:
        """Stops every process (controllers first, etcd last) and removes etcd's data."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()
        if getattr(self, "etcd_data", None) is not None:
            shutil.rmtree(self.etcd_data, ignore_errors=True)
