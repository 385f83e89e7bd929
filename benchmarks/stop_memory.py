"""What a stopped engine leaves allocated on the GPU, engine after engine in one process, and how much of it is
cuBLAS's per-stream workspaces (torch keeps one per stream cuBLAS ran on, for the process's life).

  python3 -P benchmarks/stop_memory.py [--engines 3]

Run from the repository root (it builds the tests' small GQA Llama checkpoint). Once every
graph capture took a new side stream, so each engine left one more workspace behind; now every capture shares one
(engine/cuda_graph_runner.capture_stream) and what is left stays flat.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, "tests")
    from engine_checkpoints import write

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine

    folder = write("llama-gqa-llama3rope", Path(tempfile.mkdtemp()))
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    for i in range(args.engines):
        piecewise = 0 if i == 0 else -1  # the first without piecewise graphs, then the default
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", max_running_requests=4,
                                     piecewise_graph_tokens=piecewise))
        engine.start()
        engine.stop()
        del engine
        print(f"engine {i + 1} (--piecewise-graph-tokens {piecewise}) stopped: "
              f"{(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB left allocated", flush=True)
    torch._C._cuda_clearCublasWorkspaces()
    print(f"after clearing cuBLAS's workspaces: {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
