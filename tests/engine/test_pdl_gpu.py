"""Programmatic dependent launch (engine/layers/pdl.py) changes when kernels start, never what they compute.

A kernel launched with it that read its predecessor's output before that predecessor finished would read
the previous input's values: in a CUDA graph the intermediates live at the same addresses every replay.
So each replay here takes a new input, and every replay's bits must equal the same input's without PDL.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from engine_checkpoints import write

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.layers import pdl
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams


def sm90() -> bool:
    return torch.cuda.is_available() and pdl.supported(torch.device("cuda"))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not sm90(), reason="needs a CUDA device of sm_90 or later")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, PAGE = 4096, 32, 8, 128, 14336, 32768, 16


class BatchOneLayer:
    """One Llama-8B-shaped decoder layer at batch 1 and an LM head, through the decode step's Triton kernels
    in the order a decode step launches them: each reads what the one before it wrote."""

    def __init__(self, context: int) -> None:
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(0)

        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)

        self.embed = torch.randn(VOCAB, HIDDEN, device=dev, generator=gen).to(torch.bfloat16)
        self.qkv, self.o = weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), weight(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up, self.down, self.head = weight(2 * FFN, HIDDEN), weight(HIDDEN, FFN), weight(VOCAB, HIDDEN)
        self.norm = (1 + 0.1 * torch.randn(HIDDEN, device=dev, generator=gen)).to(torch.bfloat16)
        pages = context // PAGE + 1
        self.k_cache = torch.randn(pages * PAGE + PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen).to(
            torch.bfloat16)
        self.v_cache = torch.randn_like(self.k_cache)
        self.page_table = torch.randperm(pages, device=dev, generator=gen).to(torch.int32).view(1, pages) + 1
        inv_freq = 1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)
        angles = torch.arange(context + 1, device=dev).float()[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()
        self.ids = torch.zeros(1, dtype=torch.int64, device=dev)
        self.positions = torch.full((1,), context, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(1, dtype=torch.int64, device=dev)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        from splitserve.engine.layers.fused_triton import add_rmsnorm, decode_inputs, silu_and_mul
        from splitserve.engine.layers.paged_decode_triton import NewTokenKV, paged_decode_attention
        from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm
        from splitserve.engine.sampling.argmax_triton import argmax_rows

        ids, loc, seq_lens, _ = decode_inputs(self.ids, self.positions, self.slots, self.page_table, PAGE, None)
        x = self.embed[ids]  # torch's own kernel between ours: launched without PDL
        h, _ = add_rmsnorm(x, self.norm, 1e-5)
        qkv = skinny_gemm(h, self.qkv)
        q = qkv[:, :HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(1, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(1, KV_HEADS, HEAD_DIM)
        new = NewTokenKV(k=k, v=v, cos=self.cos, sin=self.sin, out_cache_loc=loc)
        attn = paged_decode_attention(q, self.k_cache, self.v_cache, self.page_table, self.slots, seq_lens, PAGE,
                                      HEAD_DIM ** -0.5, new_kv=new)
        h, residual = add_rmsnorm(skinny_gemm(attn.view(1, -1), self.o), self.norm, 1e-5, x)
        mlp = skinny_gemm(silu_and_mul(skinny_gemm(h, self.gate_up)), self.down)
        h, _ = add_rmsnorm(mlp, self.norm, 1e-5, residual)
        logits = skinny_gemm(h, self.head)
        return logits, argmax_rows(logits)


def test_every_replay_of_a_graph_with_pdl_gives_the_bits_of_the_same_input_without_it() -> None:
    layer = BatchOneLayer(context=1000)
    inputs = torch.randint(0, VOCAB, (12,)).tolist()
    try:
        pdl.install(False)
        want = []
        for token in inputs:
            layer.ids.fill_(token)
            logits, best = layer()
            want.append((logits.clone(), best.clone()))

        pdl.install(True)
        for token, (logits_want, _) in zip(inputs[:2], want, strict=False):  # eager, and compiles the PDL kernels
            layer.ids.fill_(token)
            assert torch.equal(layer()[0], logits_want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, best = layer()
        for token, (logits_want, best_want) in zip(inputs, want, strict=True):
            layer.ids.fill_(token)
            graph.replay()
            assert torch.equal(logits, logits_want) and torch.equal(best, best_want), token
    finally:
        pdl.install(False)
    assert len({tuple(w[0][0, :8].tolist()) for w in want}) > 1  # the inputs really differ


def greedy_tokens(folder: Path, prompts: list[list[int]], mode: str) -> list[list[int]]:
    """Every prompt at once through an engine (graphs and the overlap scheduler), --pdl `mode`."""
    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4,
                                 max_total_tokens=8192, max_running_requests=16, pdl=mode))
    engine.start()
    try:
        assert pdl.enabled() is (mode == "on")
        return generate_tokens(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
                               timeout=120)
    finally:
        engine.stop()


def test_greedy_tokens_through_the_engine_are_the_same_with_pdl_on_and_off(tmp_path: Path) -> None:
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 3, 64, 9)]
    try:
        off = greedy_tokens(folder, prompts, "off")
        on = greedy_tokens(folder, prompts, "on")
    finally:
        pdl.install(False)
    assert on == off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,n,k", [(1, 1000, 900), (3, 96, 64), (40, 4096, 14336), (1, 28672, 4096)])
def test_the_skinny_kernel_with_pdl_gives_the_bits_without(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
    try:
        pdl.install(False)
        want = skinny_gemm(x, w)
        pdl.install(True)
        got = skinny_gemm(x, w)
    finally:
        pdl.install(False)
    assert torch.equal(got, want)


# A global memory access in PTX: loads, stores, atomics and reductions in the global space, and the async copies
# that read global memory into shared (cp.async, the TMA's cp.async.bulk, cp.reduce.async.bulk).
GLOBAL_ACCESS = re.compile(r"\b(?:(?:ld|st|atom|red)(?:\.[a-z0-9]+)*\.global\b|cp\.async\b|cp\.reduce\.async\b)")


def waits_before_its_first_global_access(ptx: str) -> bool:
    """Whether the kernel's first instruction that touches global memory comes after its griddepcontrol.wait,
    in the order of the PTX text (the wait is the first statement of every kernel that takes PDL, so it sits
    in the entry block, before any branch)."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    first = GLOBAL_ACCESS.search(body)
    return wait >= 0 and "griddepcontrol.launch_dependents" in body and (first is None or wait < first.start())


def kernels_taking_pdl() -> dict[str, object]:
    """Every Triton kernel of the engine that takes the PDL constexpr (engine/layers/*_triton.py,
    engine/sampling/*_triton.py), by module and name; the wait's own helper aside."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import splitserve.engine.layers as layers
    import splitserve.engine.sampling as sampling

    found = {}
    for package in (layers, sampling):
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.endswith("_triton") or info.name == "pdl_triton":
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, fn in vars(module).items():
                while not isinstance(fn, JITFunction) and isinstance(getattr(fn, "fn", None), JITFunction):
                    fn = fn.fn  # an autotuner or heuristics around the kernel
                if isinstance(fn, JITFunction) and fn.__module__ == module.__name__ and "PDL" in fn.arg_names:
                    found[f"{info.name}.{name}"] = fn
    return found


def test_every_kernel_compiled_for_pdl_waits_before_it_touches_global_memory(tmp_path: Path) -> None:
    # The replay test above compares bits, so a wait that the compiler moved after a load, or a launch that never
    # overlapped, could pass it. Here each kernel an engine compiled with launch_pdl (prefill, mixed and decode
    # steps through graphs) is read in PTX: no global load, store or async copy may come before its wait.
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 40, 17, 300, 9)]
    try:
        greedy_tokens(folder, prompts, "on")
    finally:
        pdl.install(False)
    kernels = kernels_taking_pdl()
    assert len(kernels) >= 11, sorted(kernels)
    checked: dict[str, int] = {}
    for name, fn in kernels.items():
        for compiled in (k for cache in fn.device_caches.values() for k in cache[0].values()):
            if compiled.metadata.launch_pdl:
                assert waits_before_its_first_global_access(compiled.asm["ptx"]), name
                checked[name] = checked.get(name, 0) + 1
    # The verify step's KV store runs only in speculative decoding; every other kernel ran with PDL here.
    missing = set(kernels) - set(checked)
    assert missing <= {"paged_decode_triton._store_rotated_kv"}, (sorted(missing), checked)
