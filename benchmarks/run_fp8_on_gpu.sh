#!/usr/bin/env bash
# FP8 on one GPU, in one run, most telling first: `splitserve bench --profile fp8` (decode at batch 1, prefill at
# 8k and the 256 x 512/256 burst against bfloat16, with and without an FP8 KV cache; the decode step with e4m3
# decode rows), the FP8 GPU tests, the batch-1 FP8 decode step taken apart kernel by kernel (--fp8-decode-rows
# $DECODE_ROWS, w8a8 unless set), the e4m3-rows kernel's launches, the FP8-KV decode attention kernel's launches
# at 256 x 640 tokens, and the skinny W8A16 kernel's launches at 1 and 8 rows. Each part has its own time limit
# (env, seconds), so a run cut short still leaves what it finished. Run from the repository root; files go to $OUT, wheels from
# $WHEELS (.whl).
#   OUT=out benchmarks/run_fp8_on_gpu.sh
set -uo pipefail
out=${OUT:?}
t0=$(date +%s); el() { echo "$(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl > /tmp/pip.txt 2>&1
mkdir -p /tmp/fp8run && ln -sfn "$PWD" /tmp/fp8run/splitserve
export PYTHONPATH=/tmp/fp8run:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
step() {  # name seconds command...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "$name rc=$? at $(el)" | tee -a "$out/$name.txt"
}
step bench "${BENCH_S:-150}" python3 -P -m splitserve bench --profile fp8 --shape llama-3.1-8b --device cuda \
    --no-accuracy --output "$out/bench_fp8.json"
grep -A8 "^FP8 vs bf16" "$out/bench.txt"
step tests "${TEST_S:-130}" python3 -P -m pytest -p no:cacheprovider -q -rf --tb=short tests/engine/test_e4m3_gpu.py \
    tests/engine/test_fp8_gpu.py tests/engine/test_fp8_kv_gpu.py
tail -3 "$out/tests.txt"
step profile "${PROFILE_S:-80}" python3 -P benchmarks/decode_step_profile.py --batch 1 --context 1024 \
    --quantization fp8 --fp8-decode-rows "${DECODE_ROWS:-w8a8}" --pdl off --output "$out/profile_fp8_b1.json"
tail -16 "$out/profile.txt"
step w8a8 "${W8A8_S:-150}" python3 -P benchmarks/fp8_w8a8_skinny.py --rows 1 8 --json "$out/w8a8_fp8.json"
grep "a layer's" "$out/w8a8.txt"
step attention "${ATTENTION_S:-90}" python3 -P benchmarks/attention_sweep.py --what decode --decode-cases 256x640 \
    --kv-cache-dtype fp8_e4m3 --json "$out/attention_fp8.json"
grep "default\|^ *256" "$out/attention.txt" | head -8
step gemv "${GEMV_S:-200}" python3 -P benchmarks/fp8_gemv_sweep.py --rows 1 8 --json "$out/gemv_fp8.json"
tail -12 "$out/gemv.txt"
