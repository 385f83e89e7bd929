#!/usr/bin/env bash
# Issue 16 on a lent H200: the CUDA IPC backend's GPU tests and benchmark, then a py-spy profile of
# the HTTP server under 256 concurrent requests (no network there; wheels travel in .whl/).
#   benchmarks/run_cuda_ipc_on_gpu.sh OUT_DIR WHEEL_DIR [ipc|profile|all]
set -uo pipefail
out=${1:?output folder}; wheels=${2:?wheel folder}; what=${3:-all}
mkdir -p "$out" /tmp/site /tmp/sp
for whl in "$wheels"/*.whl; do
    [[ -e "$whl" ]] || continue
    mod=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
    case $mod in pyzmq) mod=zmq;; esac
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl" 2>&1 | tail -1
done
# py-spy, and httptools (this branch's uvicorn HTTP parser) kept off main's path for the comparison
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .gpuwheels/py_spy-*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --target /tmp/httptools .gpuwheels/httptools-*.whl 2>&1 | tail -1
ln -sfn "$PWD" /tmp/sp/splitserve
export PYTHONPATH=/tmp/sp:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$out/ipc_tests.txt"
if [[ $what == ipc || $what == all ]]; then
    timeout 120 python3 -P -m pytest -p no:cacheprovider -q -x tests/transfer/test_cuda_ipc_transfer.py \
        ${IPC_ENGINE_TEST-tests/engine/test_disaggregation_cuda_ipc.py} --tb=short >> "$out/ipc_tests.txt" 2>&1
    tail -15 "$out/ipc_tests.txt"
    timeout 70 python3 -P -m splitserve bench --profile transfer --transfer-protocol cuda_ipc \
        --json "$out/cuda_ipc_transfer_h200.json" > "$out/ipc_bench.txt" 2>&1
    tail -12 "$out/ipc_bench.txt"
fi
if [[ $what == profile || $what == all ]]; then
    # main's code as sent (the checkout's root, Python's 5 ms switch interval) against this branch (1 ms)
    timeout 150 python3 -P benchmarks/profile_http.py /tmp/prof --py-spy /tmp/pyspy/bin/py-spy --profile-index 1 \
        --variants "main=$(cd ../.. && pwd):5" "branch=$PWD:1:/tmp/httptools" > "$out/profile.log" 2>&1
    tail -5 "$out/profile.log"
    cp /tmp/prof/profile_http.json /tmp/prof/pyspy_gil.txt "$out/" 2>/dev/null
    for f in /tmp/prof/server_*.log; do echo "== $f"; tail -c 1500 "$f"; done > "$out/server_tail.txt" 2>/dev/null
fi
