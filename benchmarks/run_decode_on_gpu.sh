#!/usr/bin/env bash
# A/B of the 256-row decode step on one H200: the step's per-kernel profile on this checkout (A) and on
# another tree copied into it (B, at $B_TREE), the GPU tests of
# what B changes, then benchmarks/engine_loads.py on A and on B. Logs and JSON go to $OUT.
#   B_TREE=path/to/b OUT=out benchmarks/run_decode_on_gpu.sh     (from the checkout, on the GPU machine; wheels in .whl)
set -uo pipefail
source "$(dirname "$0")/ab_trees.sh"  # out, b, log, mark; /tmp/a and /tmp/b
python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl >> "$log" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 1000 > "$out/clocks.csv" 2>&1 &
smi=$!
profile() {  # label tree seconds [flags]
    mark "profile $1"
    PYTHONPATH=/tmp/$2:/tmp/site timeout "$3" python3 -P "$b/benchmarks/decode_step_profile.py" --label "$1" \
        --output "$out/profile_$1.json" "${@:4}" > /tmp/profile_$1.txt 2>&1
    echo "rc=$?" >> /tmp/profile_$1.txt
    grep -v "^Loading\|^decode_step_profile\|^splitserve" /tmp/profile_$1.txt | tail -30 | tee -a "$log"
}
profile A a "${PROFILE_A_S:-60}" --gemm-variants --small-variants
profile B b "${PROFILE_B_S:-40}"
mark tests
(cd "$b" && PYTHONPATH=/tmp/b:/tmp/site timeout "${TEST_S:-50}" python3 -P -m pytest -p no:cacheprovider -q -rf \
    --tb=short tests/engine/test_gpu_path.py -k "graphs or argmax or decode_inputs" > "$out/gpu_tests.txt" 2>&1;
    echo "pytest rc=$?" >> "$out/gpu_tests.txt")
tail -4 "$out/gpu_tests.txt" | tee -a "$log"
loads() {  # label tree script
    mark "engine_loads $1"
    PYTHONPATH=/tmp/$2:/tmp/site timeout "${LOADS_S:-60}" python3 -P "$3" --shape llama-3.1-8b \
        --loads 256x512:256 --decode 256x1024 --output "$out/loads_$1.json" > /tmp/loads_$1.txt 2>&1
    echo "rc=$?" >> /tmp/loads_$1.txt
    grep -v "^Loading" /tmp/loads_$1.txt | tail -6 | tee -a "$log"
}
loads A a benchmarks/engine_loads.py
loads B b "$b/benchmarks/engine_loads.py"
mark done
kill "$smi"
