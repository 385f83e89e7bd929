#!/usr/bin/env bash
# The engine benchmark and the GPU tests on one H200 with no network access:
# the image's python3 has torch, triton and transformers; the few pure-Python packages it may
# lack travel as wheels in .whl/ and are installed only where missing. splitserve is imported
# from this checkout through a symlink (the image has no editable install).
#   benchmarks/run_on_gpu.sh OUT_DIR [tests|bench|all] [extra bench flags...]
set -uo pipefail
out=${1:?output folder}; what=${2:-all}; shift 2 || shift $#
mkdir -p "$out"
for whl in .whl/*.whl; do
    [[ -e "$whl" ]] || continue
    mod=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
    case $mod in python_dateutil) mod=dateutil;; pillow) mod=PIL;; pyzmq) mod=zmq;; esac
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$whl" 2>&1 | tail -1
done
mkdir -p /tmp/splitserve-path && ln -sfn "$PWD" /tmp/splitserve-path/splitserve
export PYTHONPATH=/tmp/splitserve-path PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
if [[ $what == tests || $what == all ]]; then
    python3 -P -m pytest -p no:cacheprovider -q tests/engine/test_gpu_path.py tests/engine/test_sampling.py \
        tests/engine/test_model_parity.py --tb=short 2>&1 | tail -60 | tee "$out/gpu_tests.txt"
fi
if [[ $what == bench || $what == all ]]; then
    python3 -P -m splitserve bench --profile engine --shape llama-3.1-8b --device cuda \
        --output "$out/engine_llama-3.1-8b_h200.json" --plot "$out/engine_llama-3.1-8b_h200.png" "$@" 2>&1 \
        | grep -v "^Loading weights" | tail -40
fi
