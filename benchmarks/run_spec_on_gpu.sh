#!/usr/bin/env bash
# The speculative decoding benchmark on one H200 (verifier and drafters share it):
# the Llama-3.1-8B shape with random weights, layers 5.. with zero o_proj/down_proj, a 4-layer
# drafter sharing embeddings/norm/head (every draft accepted) and a perturbed one; batch 1/8/32,
# K = 2/4/8, tokens/s against plain decoding measured first in the same run.
#   benchmarks/run_spec_on_gpu.sh OUT_DIR [extra bench flags, e.g. --ks 4 --output-len 256]
# Run from the repository root (or a copy of it). Environment:
#   SPEC_WHEELS   folder of the grpcio/protobuf/pyzmq/starlette/uvicorn wheels (default .whl),
#                 installed into /tmp/spec-site, ahead of the image's own
#   SPEC_GEMV=1   first the row-invariant path (skinny kernel, wide kernel past 32 rows) against cuBLAS at 1-288 rows
#                 (benchmarks/gemv_sweep.py --rows; gemv_rows.json)
#   SPEC_BENCH=0  skip the benchmark (then: spec_llama-3.1-8b_h200.json, .log)
#   SPEC_TESTS=1  last tests/engine/test_speculative_gpu.py and the skinny tests of test_gpu_path.py
#                 (the image's pytest; gpu_tests.txt)
#   SPEC_*_TIMEOUT  seconds for each part
set -uo pipefail
out=${1:?output folder}; shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/spec-site "${SPEC_WHEELS:-.whl}"/*.whl \
    > "$out/pip.txt" 2>&1
mkdir -p /tmp/splitserve-path && ln -sfn "$PWD" /tmp/splitserve-path/splitserve
export PYTHONPATH=/tmp/splitserve-path:/tmp/spec-site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -P -c "import torch, triton, grpc, google.protobuf, zmq; print('torch', torch.__version__, 'triton', \
triton.__version__, 'grpc', grpc.__version__, 'protobuf', google.protobuf.__version__)" | tee -a "$out/gpu.txt"
if [[ "${SPEC_GEMV:-0}" == 1 ]]; then
    timeout "${SPEC_GEMV_TIMEOUT:-90}" python3 -P benchmarks/gemv_sweep.py --rows 1 8 16 32 40 64 96 128 160 288 \
        --json "$out/gemv_rows.json" 2>&1 | tee "$out/gemv_rows.txt" | grep "8B step"
fi
if [[ "${SPEC_BENCH:-1}" == 1 ]]; then
    timeout "${SPEC_BENCH_TIMEOUT:-300}" python3 -P -m splitserve bench --profile spec --shape llama-3.1-8b \
        --device cuda --workdir /tmp/spec-ckpt --output "$out/spec_llama-3.1-8b_h200.json" "$@" \
        > "$out/spec_llama-3.1-8b_h200.log" 2>&1
    echo "bench rc=$?" >> "$out/spec_llama-3.1-8b_h200.log"
    cp /tmp/spec-ckpt/drafter-*.log "$out/" 2>/dev/null  # each drafter process's own log
    grep -v "^Loading weights" "$out/spec_llama-3.1-8b_h200.log" | grep -E "bench_spec|rc=|Error|error" | tail -40
    grep -A30 "^speculative decoding" "$out/spec_llama-3.1-8b_h200.log"
fi
if [[ "${SPEC_TESTS:-0}" == 1 ]]; then
    timeout "${SPEC_TEST_TIMEOUT:-200}" python3 -P -m pytest -p no:cacheprovider -q -s -rA \
        tests/engine/test_speculative_gpu.py "tests/engine/test_gpu_path.py::test_skinny_gemm_matches_torch_and_a_row_does_not_depend_on_the_others" \
        > "$out/gpu_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$out/gpu_tests.txt"
    grep -E "passed|failed|^FAILED|^PASSED|identical|rc=" "$out/gpu_tests.txt" | tail -30
fi
