#!/usr/bin/env bash
# The cuDNN attention paths on one H200, in one run: their GPU tests on this tree,
# then benchmarks/sdpa_shape_cost.py --engine and benchmarks/cudnn_paths_bits.py on this tree (after) and
# on a tree before the change (before; BEFORE=path to its root), both in the same run. Run from the
# repository root with this tree under TREE (default: the root itself); files go to $OUT, wheels from $WHEELS (.whl).
set -uo pipefail
out=${OUT:?}
tree=$(cd "${TREE:-.}" && pwd)
before=$(cd "${BEFORE:?the tree before the change}" && pwd)
t0=$(date +%s); el() { echo "$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl > /tmp/pip.txt 2>&1
mkdir -p /tmp/after /tmp/before && ln -sfn "$tree" /tmp/after/splitserve && ln -sfn "$before" /tmp/before/splitserve
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader > "$out/gpu.txt"
cd "$tree"
PYTHONPATH=/tmp/after:/tmp/site timeout "${TEST_S:-80}" python3 -P -m pytest -p no:cacheprovider -q -rs -rf \
    --tb=short --durations=10 tests/engine/test_gpu_path.py tests/engine/test_wide_gemm.py \
    -k "(cudnn or bucket or lone_prompt or wide_gemm or launch) and not paged_decode and not decode_kernel" \
    > "$out/gpu_tests.txt" 2>&1
echo "pytest rc=$? at $(el)" >> "$out/gpu_tests.txt"
grep -E "passed|failed|FAILED|ERROR|rc=" "$out/gpu_tests.txt" | tail -8
lengths=${LENGTHS:-97 233 301 640 1000 1500 1790 2040 2500 3500}
for side in before after; do
    PYTHONPATH=/tmp/$side:/tmp/site timeout "${PROBE_S:-30}" python3 -P benchmarks/sdpa_shape_cost.py --engine \
        --lengths $lengths --json "$out/sdpa_$side.json" 2>&1 | grep -v "Warning\|scaled_dot_product" \
        > "$out/sdpa_$side.txt"
    echo "probe $side rc=${PIPESTATUS[0]} at $(el)" >> "$out/sdpa_$side.txt"
    PYTHONPATH=/tmp/$side:/tmp/site timeout "${BITS_S:-20}" python3 -P benchmarks/cudnn_paths_bits.py \
        --save "/tmp/bits_$side.pt" > "/tmp/bits_$side.txt" 2>&1 || tail -3 "/tmp/bits_$side.txt"
done
python3 -P benchmarks/cudnn_paths_bits.py --compare /tmp/bits_before.pt /tmp/bits_after.pt > "$out/bits.txt" 2>&1
echo "bits at $(el)" >> "$out/bits.txt"
cat "$out/sdpa_before.txt" "$out/sdpa_after.txt" "$out/bits.txt"
echo "done at $(el)"
