#!/usr/bin/env bash
# The cluster-shape run on a 2-GPU H200 machine with no network access: 1 prefill + 1 decode
# engine (one GPU each, KV over Mooncake TCP between the GPUs) against 2 data-parallel unified
# replicas on the same GPUs, behind the same router, Llama-3.1-8B shape with random weights.
# What the image lacks travels in .mc/ (git-ignored): Mooncake's CUDA build stripped to the
# transfer engine, libcudart 12 (Mooncake 0.3.13 links it; the image has CUDA 13), the Debian
# libraries Mooncake links (libibverbs, libnuma, libcurl, ...) used only where the image has no
# copy, and a few pure-Python wheels.
#   benchmarks/run_pd_on_gpus.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out" /tmp/sys/only
for deb in .mc/debs/*.deb; do dpkg -x "$deb" /tmp/sys; done
for lib in libibverbs.so.1 libmlx5.so.1 libnuma.so.1 libcurl.so.4 libnghttp2.so.14 librtmp.so.1 libssh2.so.1 \
           libpsl.so.5 libldap-2.5.so.0 liblber-2.5.so.0 libgssapi_krb5.so.2 libbrotlidec.so.1 libbrotlicommon.so.1 \
           libkrb5.so.3 libk5crypto.so.3 libkrb5support.so.0 libsasl2.so.2 libkeyutils.so.1; do
    ldconfig -p | grep -q "^\s*$lib " && continue
    found=$(find /tmp/sys -name "$lib*" | head -1)
    [[ -n "$found" ]] && ln -sf "$found" "/tmp/sys/only/$lib" && echo "carried $lib"
done
export LD_LIBRARY_PATH=/tmp/sys/only:$PWD/.mc/site/mooncake_transfer_engine.libs:${LD_LIBRARY_PATH:-}
for whl in .mc/whl/*.whl; do
    mod=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z'); [[ $mod == pyzmq ]] && mod=zmq
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --no-deps "$whl" 2>&1 | tail -1
done
mkdir -p /tmp/splitserve-path && ln -sfn "$PWD" /tmp/splitserve-path/splitserve
export PYTHONPATH=/tmp/splitserve-path:$PWD/.mc/site PYTHONUNBUFFERED=1 MC_TCP_BIND_ADDRESS=127.0.0.1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
nvidia-smi topo -m | head -4 | tee -a "$out/gpus.txt"
python3 - <<'PY' 2>&1 | tee "$out/limits.txt"
import time, torch
from mooncake.engine import TransferEngine
e = TransferEngine()
print("mooncake tcp initialize:", e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0"); b = torch.empty_like(a, device="cuda:1")
for _ in range(3): b.copy_(a)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): b.copy_(a)
torch.cuda.synchronize(); print(f"gpu0->gpu1 copy: {10 * (1 << 30) / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
folder=/tmp/llama-3.1-8b-shape
python3 -P -c "from pathlib import Path; from splitserve.engine.checkpoints.model_shapes import write_shape_folder; write_shape_folder('llama-3.1-8b', Path('$folder'))"
# Each phase has its own deadline and writes its whole log under $out: a call cut short by the
# device's time limit still brings back how far it got (an earlier run lost everything to `| tail`).
timeout 420 python3 -P -m splitserve bench --profile pd --model "$folder" --device cuda --unified-replicas 2 \
    --engine-args "--load-format dummy --max-total-tokens 300000 --max-running-requests 64 --cuda-graph-max-batch 64" \
    --input-len 4096 --output-len 256 --num-requests 32 --concurrency-levels 4 16 \
    --output "$out/pd_vs_unified_llama-3.1-8b_h200x2.json" > "$out/pd_run.log" 2>&1
grep -v "^[IWE]1[0-9][0-9][0-9] " "$out/pd_run.log" | tail -30
timeout 240 python3 -P benchmarks/tp_gpu_check.py > "$out/tp_gpu_check.txt" 2>&1; tail -3 "$out/tp_gpu_check.txt"
