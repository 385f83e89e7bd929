"""Kernel time with no launch gaps: calls captured into one CUDA graph, replayed and timed by events.

Used by the GEMM sweeps (benchmarks/gemv_sweep.py, benchmarks/wide_gemm_sweep.py). Each call reads
its own copy of the weights, so that a sweep times reads from HBM rather than from L2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fn_per_copy: Callable[[int], object], copies: int, reps: int = 10) -> float:
    """Microseconds per call of `fn_per_copy(i)` for i in range(copies), all captured into one graph
    (after one eager pass that compiles and warms), averaged over `reps` replays."""
    for i in range(copies):
        fn_per_copy(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_per_copy(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph  # its memory back before the next shape's weights are made
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def device_copy_gbs() -> float:
    """Device-to-device copy rate of 1 GiB (bytes read + written, per second), timed as the kernels are: the
    HBM bound a sweep's figures are put against. The copy is a kernel that reads and writes every 8-byte word,
    as the kernels it bounds do; a graph-captured `copy_` is a memcpy node, which the driver may hand to a copy
    engine rather than the SMs."""
    src = torch.zeros(1 << 27, dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 8 / graph_time_us(lambda _i: torch.bitwise_not(src, out=dst), 1) / 1e3
