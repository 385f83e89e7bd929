#!/usr/bin/env bash
# Runs the whole test suite as CI does: installs what the tests need, starts nothing by hand
# (fixtures start etcd, kube-apiserver, engines, ...), lints, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# -P: never put the repo root on sys.path, where operator/ would shadow the standard library.
PY=${PYTHON:-python3}
scripts/install.sh --test

# The operator tests need etcd, kube-apiserver and kube-controller-manager binaries; this
# builds them once into a cache outside the repo (or uses $KUBEBUILDER_ASSETS) and helm.
if [[ -x scripts/k8s_assets.sh ]]; then
    export KUBEBUILDER_ASSETS="$(scripts/k8s_assets.sh)"
fi

echo "[test] ruff" >&2
"$PY" -P -m ruff check .

echo "[test] pytest" >&2
set +e
"$PY" -P -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: not a failure of the code, but say so.
if [[ $rc -eq 5 ]]; then
    echo "[test] pytest collected no tests" >&2
    exit 0
fi
exit $rc
