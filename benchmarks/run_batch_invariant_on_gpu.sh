#!/usr/bin/env bash
# Batch-invariant mode (bf16 identity with drafts) on one H200, in one run: the row-invariant path's bits
# at 1-300 rows for every Llama-3.1-8B projection (and whether the skinny and wide kernels agree), its
# cost per row count against cuBLAS, the decode attention's cost per split count, the spec bench with
# --batch-invariant at batch 8 and 32, then the GPU tests of the mode.
#   benchmarks/run_batch_invariant_on_gpu.sh OUT_DIR [extra bench flags, e.g. --no-speculation-gate]
#   (SPEC_WHEELS: the draft-mesh wheels, as run_spec_on_gpu.sh)
# If the skinny kernel's rows differ from the wide kernel's, the run goes on with one kernel for every
# row count in the mode (SKINNY_MATCHES_WIDE = False in this copy), and says so.
set -uo pipefail
out=${1:?output folder}; shift
mkdir -p "$out/spec"
python3 -m pip install -q --no-index --no-deps --target /tmp/spec-site "${SPEC_WHEELS:-.whl}"/*.whl > /dev/null 2>&1
mkdir -p /tmp/splitserve-path && ln -sfn "$PWD" /tmp/splitserve-path/splitserve
export PYTHONPATH=/tmp/splitserve-path:/tmp/spec-site PYTHONUNBUFFERED=1
pytest=(python3 -P -m pytest -p no:cacheprovider -q -s -rA)
timeout 90 "${pytest[@]}" tests/engine/test_gpu_path.py -k row_invariant_row > "$out/bits.txt" 2>&1
echo "pytest rc=$?" >> "$out/bits.txt"
grep -E "values differ|passed|failed|rc=" "$out/bits.txt"
if grep -q "vs the path's: [1-9]" "$out/bits.txt"; then
    sed -i 's/^SKINNY_MATCHES_WIDE = True/SKINNY_MATCHES_WIDE = False/' engine/layers/skinny.py
    echo "skinny and wide kernels differ: one kernel (wide) for every row count from here on" | tee -a "$out/bits.txt"
    timeout 90 "${pytest[@]}" tests/engine/test_gpu_path.py -k row_invariant_row >> "$out/bits.txt" 2>&1
    grep -E "values differ|passed|failed" "$out/bits.txt" | tail -6
fi
timeout 60 python3 -P benchmarks/gemv_sweep.py --rows 1 8 32 40 72 96 160 288 --json "$out/gemv_rows.json" \
    > "$out/gemv_rows.txt" 2>&1
grep "8B step" "$out/gemv_rows.txt"
timeout 40 python3 -P benchmarks/decode_splits_cost.py --json "$out/decode_splits.json" 2>&1 | tail -12
SPEC_BENCH_TIMEOUT=${SPEC_BENCH_TIMEOUT:-150} bash benchmarks/run_spec_on_gpu.sh "$out/spec" --batch-sizes 8 32 \
    --perturbed-acceptance 0 --output-len 96 --batch-invariant "$@" | tail -14
rm -f "$out/spec/pip.txt"
timeout "${TEST_S:-120}" "${pytest[@]}" tests/engine/test_speculative_gpu.py tests/engine/test_gpu_path.py \
    -k "(bfloat16_greedy and (8 or 32)) or bits_do_not or skinny_gemm_matches" > "$out/gpu_tests.txt" 2>&1
echo "pytest rc=$?" >> "$out/gpu_tests.txt"
grep -E "identical|passed|failed|^FAILED|rc=" "$out/gpu_tests.txt" | cut -c1-400 | tail -14
