#!/usr/bin/env bash
# The speculative decoding benchmark of issue 13 on one H200 (verifier and drafters share it):
# the Llama-3.1-8B shape with random weights, layers 5.. with zero o_proj/down_proj, a 4-layer
# drafter sharing embeddings/norm/head (every draft accepted) and a perturbed one; batch 1/8/32,
# K = 2/4/8, tokens/s against plain decoding measured first in the same run.
#   benchmarks/run_spec_on_gpu.sh OUT_DIR [extra bench flags, e.g. --perturb 0.5]
set -uo pipefail
out=${1:?output folder}; shift
mkdir -p "$out"
# The draft mesh needs grpcio/protobuf at least as new as its generated modules, and pyzmq; they
# travel as wheels in .whl/ (carry it) and are installed only where the image's are missing or older.
python3 -m pip install -q --no-index --no-deps --find-links .whl "grpcio>=1.85.1" "protobuf>=7.35.1" "pyzmq>=25" \
    2>&1 | tail -2
for whl in .whl/starlette-*.whl .whl/uvicorn-*.whl; do
    [[ -e "$whl" ]] || continue
    mod=$(basename "$whl" | cut -d- -f1)
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$whl" 2>&1 | tail -1
done
python3 -c "import grpc, google.protobuf, zmq; print('grpc', grpc.__version__, 'protobuf', google.protobuf.__version__)"
mkdir -p /tmp/splitserve-path && ln -sfn "$PWD" /tmp/splitserve-path/splitserve
export PYTHONPATH=/tmp/splitserve-path PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# SPEC_TEST_WHEELS=folder: first the GPU tests of speculative decoding (pytest from those wheels).
if [[ -n "${SPEC_TEST_WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/spec-test-site "$SPEC_TEST_WHEELS"/*.whl 2>&1 | tail -1
    PYTHONPATH=/tmp/splitserve-path:/tmp/spec-test-site timeout "${SPEC_TEST_TIMEOUT:-300}" python3 -P -m pytest \
        -p no:cacheprovider -q -s -rA tests/engine/test_speculative_gpu.py 2>&1 | tee "$out/gpu_tests.txt" | tail -40
fi
python3 -P -m splitserve bench --profile spec --shape llama-3.1-8b --device cuda --workdir /tmp/spec-ckpt \
    --output "$out/spec_llama-3.1-8b_h200.json" "$@" 2>&1 | grep -v "^Loading weights" | tail -60 \
    | tee "$out/spec_llama-3.1-8b_h200.txt"
