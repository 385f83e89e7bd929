#!/usr/bin/env bash
# The serving figures of docs/performance.md in one run on one H200 (everything lands straight in OUT_DIR): the perturbed drafter on the default gate (the speculation budget),
# the engine's loads (the 256 x 512/256 burst with its TTFT, 4 x 8192 prefill, decode steps at batch 1 and
# 256, the first request), then every GPU test. Each stage is time-boxed; STAGES picks them.
#   benchmarks/run_loads_on_gpu.sh OUT_DIR      (from the repository root or a copy of it)
# Environment: WHEELS (grpcio/protobuf/pyzmq/starlette/uvicorn/httptools/msgpack wheels, default .whl),
#   STAGES (default "spec loads tests"), SPEC_S / LOADS_S / TEST_S (seconds for each stage).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/open-site "${WHEELS:-.whl}"/*.whl > /tmp/open-pip.txt 2>&1
mkdir -p /tmp/open-path && ln -sfn "$PWD" /tmp/open-path/splitserve
export PYTHONPATH=/tmp/open-path:/tmp/open-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader > "$out/run.txt"
stages=" ${STAGES:-spec loads tests} "
if [[ "$stages" == *" spec "* ]]; then
    # run_spec_on_gpu.sh writes pip/gpu/drafter logs beside its report: only the report comes back.
    SPEC_WHEELS="${WHEELS:-.whl}" SPEC_BENCH_TIMEOUT="${SPEC_S:-150}" bash benchmarks/run_spec_on_gpu.sh \
        /tmp/open-spec --drafters perturbed --output-len 96 --no-cublas-plain >> "$out/run.txt" 2>&1
    cp /tmp/open-spec/spec_llama-3.1-8b_h200.json "$out/spec_perturbed.json" 2>/dev/null
    cp /tmp/open-spec/spec_llama-3.1-8b_h200.log "$out/spec_perturbed.log" 2>/dev/null
    echo "spec at $(at)" | tee -a "$out/run.txt"
fi
if [[ "$stages" == *" loads "* ]]; then
    timeout "${LOADS_S:-150}" python3 -P benchmarks/engine_loads.py --loads 256x512:256 4x8192:1 \
        --decode 1x1024 256x1024 --output "$out/engine_loads.json" > "$out/loads.txt" 2>&1
    echo "loads rc=$? at $(at)" | tee -a "$out/run.txt"
    tail -25 "$out/loads.txt"
fi
if [[ "$stages" == *" tests "* ]]; then
    timeout "${TEST_S:-330}" python3 -P -m pytest -p no:cacheprovider -q -rs -rf --tb=short --durations=25 -s \
        tests/engine/test_gpu_path.py tests/engine/test_sampling.py tests/engine/test_model_parity.py \
        tests/engine/test_speculative_gpu.py tests/engine/test_wide_gemm.py tests/engine/test_gemm_algos.py \
        tests/engine/test_disaggregation_cuda_ipc.py tests/transfer/test_cuda_ipc_transfer.py \
        > "$out/gpu_tests.txt" 2>&1
    echo "pytest rc=$? at $(at)" | tee -a "$out/run.txt"
    grep -E "passed|failed|FAILED|ERROR " "$out/gpu_tests.txt" | tail -15
fi
echo "done at $(at)" | tee -a "$out/run.txt"
