#!/usr/bin/env bash
# Chunked prefill on one H200: the GPU tests of the extend paths, the extend sweep (the
# cuDNN path for chunks after a prefix against the paged extend kernel), then engine_loads with the
# cuDNN path on and off on one engine and the burst's TTFT at three step budgets. Run from a splitserve
# checkout on the GPU machine; logs and JSON under $OUT. Wheels: $WHEELS (default .whl in the checkout).
set -uo pipefail
out=${OUT:?}
here=$(cd "$(dirname "$0")/.." && pwd)
wheels=${WHEELS:-$here/.whl}
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl > "$out/pip.txt" 2>&1
mkdir -p /tmp/sp && ln -sfn "$here" /tmp/sp/splitserve
export PYTHONPATH=/tmp/sp:/tmp/site PYTHONUNBUFFERED=1
cd "$here" || exit 1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 500 \
    > "$out/clocks.csv" 2>&1 &
clocks=$!
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'cudnn', torch.backends.cudnn.version(),
torch.cuda.get_device_name())" > "$out/gpu.txt" 2>&1
t0=$(date +%s)
timeout "${TEST_S:-110}" python3 -P -m pytest -p no:cacheprovider -q -rs -rf --tb=short \
    tests/engine/test_gpu_path.py -k "${TEST_K:-cudnn or paged_extend}" > "$out/gpu_tests.txt" 2>&1
echo "pytest rc=$? at $(( $(date +%s) - t0 )) s" >> "$out/gpu_tests.txt"
tail -4 "$out/gpu_tests.txt"
[ "${SWEEP:-1}" = 1 ] && timeout "${SWEEP_S:-70}" python3 -P benchmarks/attention_sweep.py --what extend --json "$out/extend_sweep.json" \
    --extend-cases "1 x 8192" "chunk 2048 after 6144" "chunk 2048 after 4096" "chunk 2048 after 2048" \
    "chunk 1024 after 1024" "chunk 512 after 1536" "chunk 2048 after 512" > "$out/extend_sweep.txt" 2>&1
[ "${SWEEP:-1}" = 1 ] && echo "sweep rc=$? at $(( $(date +%s) - t0 )) s" >> "$out/extend_sweep.txt" &&
    grep -v "^attention_sweep" "$out/extend_sweep.txt"
timeout "${LOADS_S:-170}" python3 -P benchmarks/engine_loads.py --shape llama-3.1-8b --chunk 2048 \
    --loads 256x512:256 16x2048:1 4x8192:1 --compare-triton-extend --prefill-budgets ${BUDGETS-2048 4096 8192} \
    --output "$out/engine_loads.json" > "$out/engine_loads.txt" 2>&1
echo "loads rc=$? at $(( $(date +%s) - t0 )) s" >> "$out/engine_loads.txt"
grep -v "^engine_loads\|^Loading" "$out/engine_loads.txt" | tail -16
kill "$clocks" 2>/dev/null
