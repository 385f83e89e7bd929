#!/usr/bin/env bash
# Issue 16, transfer side, on a lent H200: the room benchmark (one room at a time by size, taken apart by
# stage, and many rooms in flight), then the CUDA IPC GPU tests. No network there: wheels travel along.
#   benchmarks/run_cuda_ipc_on_gpu.sh OUT_DIR WHEEL_DIR
set -uo pipefail
out=${1:?output folder}; wheels=${2:?wheel folder}
mkdir -p "$out" /tmp/site /tmp/sp
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl > "$out/pip.txt" 2>&1
ln -sfn "$PWD" /tmp/sp/splitserve
export PYTHONPATH=/tmp/sp:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$out/gpu.txt" 2>&1
timeout ${BENCH_S:-85} python3 -P -m splitserve bench --profile transfer --transfer-protocol cuda_ipc \
    --lanes ${LANES:-1,2} --json "$out/cuda_ipc_rooms_h200.json" > "$out/bench.txt" 2>&1
echo "bench rc=$?" >> "$out/bench.txt"
grep -v "^WARNING: Logging\|^[IWE][0-9]" "$out/bench.txt" | tail -45
timeout ${TEST_S:-110} python3 -P -m pytest -p no:cacheprovider -q -rs --tb=short tests/transfer/test_cuda_ipc_transfer.py \
    tests/engine/test_disaggregation_cuda_ipc.py > "$out/tests.txt" 2>&1
echo "pytest rc=$?" >> "$out/tests.txt"
tail -12 "$out/tests.txt"
