#!/usr/bin/env bash
# KV transfer between two processes on one GPU: the CUDA IPC GPU tests, then the rooms benchmark
# (`bench --profile transfer --transfer-protocol cuda_ipc`) of this tree and, where BEFORE names another
# tree (the code before a change, say), of that tree too, each a ratio to a device copy of the same bytes in its run.
#   benchmarks/run_cuda_ipc_on_gpu.sh OUT_DIR
# Run from the repository root (or a copy of it). Environment:
#   CIPC_WHEELS    folder of the grpcio/protobuf/pyzmq/... wheels (default .whl), into /tmp/cipc-site
#   BEFORE         another splitserve tree to benchmark first (same bench flags; its JSON: rooms_before.json)
#   CIPC_TESTS=0   skip tests/transfer/test_cuda_ipc_transfer.py and tests/engine/test_disaggregation_cuda_ipc.py
#   ROOMS          the bench's --kv-tokens / --concurrent (default "512,8192 512x256,8192x16")
#   CIPC_*_S       seconds for each part (TESTS 150, BENCH 75, PROFILE 45)
#   PIPELINE_JOBS  e.g. "16 64": this tree's 512x256 sets again with peer_workers.PIPELINE_JOBS set to each
#                  (rooms per launched copy of a pipelined batch), rooms_jobs<N>.{json,txt}
#   PYSPY          folder of a py-spy wheel: after the rooms, this tree's PROFILE_SET sets (default 512x256,
#                  PROFILE_REPEATS 20: 10 sets per page order) again under `py-spy record --gil --native --threads
#                  --subprocesses` (root), collapsed stacks in pyspy_rooms.txt.gz (PROFILE=0: only the profile)
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/cipc-site "${CIPC_WHEELS:-.whl}"/*.whl \
    > "$out/pip.txt" 2>&1
mkdir -p /tmp/cipc-after && ln -sfn "$PWD" /tmp/cipc-after/splitserve
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
PYTHONPATH=/tmp/cipc-site python3 -P -c "import torch, triton; print(torch.__version__, triton.__version__)" \
    >> "$out/gpu.txt" 2>&1
read -r tokens sets <<< "${ROOMS:-512,8192 512x256,8192x16}"
rooms() {  # tree label
    PYTHONPATH="$1:/tmp/cipc-site" timeout "${CIPC_BENCH_S:-75}" python3 -P -m splitserve bench --profile transfer \
        --transfer-protocol cuda_ipc --kv-tokens "$tokens" --concurrent "$sets" --lanes 1 --repeats 6 \
        --no-kernel-sweep --json "$out/rooms_$2.json" > "$out/rooms_$2.txt" 2>&1
    echo "rooms $2 rc=$?" >> "$out/rooms_$2.txt"
    grep -v "^WARNING: Logging\|^[IWE][0-9]\|^measured\|INFO" "$out/rooms_$2.txt" | tail -30
}
if [[ -n "${BEFORE:-}" ]]; then
    mkdir -p /tmp/cipc-before && ln -sfn "$BEFORE" /tmp/cipc-before/splitserve
    rooms /tmp/cipc-before before
fi
[[ "${PROFILE:-1}" == 1 ]] && rooms /tmp/cipc-after after
for jobs in ${PIPELINE_JOBS:-}; do
    PYTHONPATH="/tmp/cipc-after:/tmp/cipc-site" timeout "${CIPC_BENCH_S:-75}" python3 -P -c "import sys
import splitserve.transfer.peer_workers as workers
workers.PIPELINE_JOBS = int(sys.argv[1])
from splitserve.bench.cuda_ipc import main
sys.exit(main(sys.argv[2:]))" "$jobs" --transfer-protocol cuda_ipc --kv-tokens '' --concurrent 512x256 --lanes 1 \
        --repeats 6 --no-kernel-sweep --json "$out/rooms_jobs$jobs.json" > "$out/rooms_jobs$jobs.txt" 2>&1
    echo "rooms PIPELINE_JOBS=$jobs rc=$?" >> "$out/rooms_jobs$jobs.txt"
    grep -v "^WARNING: Logging\|^[IWE][0-9]\|^measured\|INFO" "$out/rooms_jobs$jobs.txt" | tail -8
done
if [[ -n "${PYSPY:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/cipc-pyspy "$PYSPY"/*.whl >> "$out/pip.txt" 2>&1
    PYTHONPATH="/tmp/cipc-after:/tmp/cipc-site" timeout "${CIPC_PROFILE_S:-45}" /tmp/cipc-pyspy/bin/py-spy record \
        -r "${PROFILE_RATE:-250}" --gil --native --threads --subprocesses -f raw -o /tmp/pyspy_rooms.txt -- \
        python3 -P -m splitserve bench --profile transfer --transfer-protocol cuda_ipc --kv-tokens '' \
        --concurrent "${PROFILE_SET:-512x256}" --lanes 1 --repeats "${PROFILE_REPEATS:-20}" --no-kernel-sweep \
        --json "$out/rooms_profiled.json" > "$out/pyspy_log.txt" 2>&1
    echo "py-spy rc=$?" >> "$out/pyspy_log.txt"
    gzip -c /tmp/pyspy_rooms.txt > "$out/pyspy_rooms.txt.gz"
    grep -v "^WARNING: Logging\|^[IWE][0-9]\|^measured\|INFO" "$out/pyspy_log.txt" | tail -12
fi
if [[ "${CIPC_TESTS:-1}" == 1 ]]; then
    PYTHONPATH=/tmp/cipc-after:/tmp/cipc-site timeout "${CIPC_TESTS_S:-150}" python3 -P -m pytest -p no:cacheprovider \
        -q -rs -rf --tb=short --durations=8 tests/transfer/test_cuda_ipc_transfer.py \
        tests/engine/test_disaggregation_cuda_ipc.py > "$out/gpu_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$out/gpu_tests.txt"
    tail -22 "$out/gpu_tests.txt"
fi
