#!/usr/bin/env bash
# A/B of the projections' GEMMs at the H200's power cap: A is this checkout, B another tree copied into it
# (B_TREE, relative to the checkout's root). Files go to $OUT.
#   STAGE=sweep benchmarks/run_gemm_on_gpu.sh   the GEMM variants under sustained load (gemm_sustained.py)
#   STAGE=loads benchmarks/run_gemm_on_gpu.sh   engine_loads.py on A then on B (B with TABLE), then B's GPU tests
set -uo pipefail
source "$(dirname "$0")/ab_trees.sh"  # out, b, log, mark; /tmp/a and /tmp/b
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > "$out/clocks.csv" 2>&1 &
smi=$!
if [[ "${STAGE:-sweep}" == sweep ]]; then
    mark sweep
    PYTHONPATH=/tmp/b timeout "${SWEEP_S:-150}" python3 -P "$b/benchmarks/gemm_sustained.py" --rows 2048 256 \
        --output "$out/gemm_sustained.json" --table-out "$out/gemm_algos.json" ${SWEEP_ARGS:-} > "$out/sweep.txt" 2>&1
    echo "rc=$? at $(( $(date +%s) - t0 )) s" >> "$out/sweep.txt"
    grep -v "^Loading" "$out/sweep.txt" | tail -80
    mark tests
    (cd "$b" && PYTHONPATH=/tmp/b timeout "${TEST_S:-60}" python3 -P -m pytest -p no:cacheprovider -q -rf \
        --tb=short tests/engine/test_gemm_algos.py > "$out/gpu_tests.txt" 2>&1; echo "pytest rc=$?" >> "$out/gpu_tests.txt")
    tail -5 "$out/gpu_tests.txt"
else
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl >> "$log" 2>&1
    loads() {  # label tree script [flags]
        mark "engine_loads $1"
        PYTHONPATH="/tmp/$2:/tmp/site" timeout "${LOADS_S:-90}" python3 -P "$3" --shape llama-3.1-8b \
            --loads ${LOADS:-256x512:256 256x512:1} --decode ${DECODE-256x1024} --output "$out/loads_$1.json" "${@:4}" \
            > /tmp/loads_$1.txt 2>&1
        echo "rc=$?" >> /tmp/loads_$1.txt
        grep "GEMM algorithm" /tmp/loads_$1.txt | cut -c1-300 | tee -a "$log"
        grep -v "^Loading" /tmp/loads_$1.txt | tail -7 | tee -a "$log"
    }
    loads A a benchmarks/engine_loads.py
    loads B b "$b/benchmarks/engine_loads.py" --gemm-algos "$PWD/$b/${TABLE:?}"
    [[ "${TESTS:-1}" == 1 ]] || { kill "$smi"; mark done; exit 0; }
    mark tests
    (cd "$b" && PYTHONPATH=/tmp/b:/tmp/site timeout "${TEST_S:-60}" python3 -P -m pytest -p no:cacheprovider -q -rf \
        --tb=short tests/engine/test_gemm_algos.py tests/engine/test_model_parity.py tests/engine/test_gpu_path.py \
        -k "${TEST_K:-gemm_algos or parity or graphs or skinny}" > "$out/gpu_tests.txt" 2>&1;
        echo "pytest rc=$?" >> "$out/gpu_tests.txt")
    tail -5 "$out/gpu_tests.txt" | tee -a "$log"
fi
kill "$smi" 2>/dev/null
mark done
