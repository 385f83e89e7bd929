"""The GPU fast path: the Triton decode kernel matches the reference, and CUDA graphs change no token.

Runs only where CUDA is (the lent H200s); CI has no GPU and skips it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_checkpoints import write
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.layers.attention import decode_attention_reference
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(32, 8, 128, 16), (6, 2, 16, 4), (28, 4, 128, 16),
                                                               (8, 8, 64, 1)])
def test_triton_paged_decode_matches_reference(heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
    from splitserve.engine.layers.paged_decode_triton import paged_decode_attention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_pages, max_pages, bsz = 600, 160, 5
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randint(1, num_pages, (bsz + 1, max_pages), device=dev, dtype=torch.int32)
    slots = torch.tensor([3, 0, 4, 1, 2], device=dev)
    seq_lens = torch.tensor([1, 7, 100, 1000, min(2500, max_pages * page_size)], device=dev)
    q = torch.randn(bsz, heads, head_dim, device=dev, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, page_table, slots, seq_lens, page_size, scale)
    want = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), page_table, slots, seq_lens,
                                      page_size, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def greedy_tokens(folder: Path, prompts: list[list[int]], **cfg) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4,
                                 max_total_tokens=8192, max_running_requests=16, **cfg))
    engine.start()
    outs: dict[str, list[int]] = {}
    finished: set[str] = set()
    done = threading.Event()

    def collect(out) -> None:
        outs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finish_reason is not None:
            finished.add(out.request_id)
            if len(finished) == len(prompts):
                done.set()

    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(str(i), list(p), SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
                                  collect))
        assert done.wait(120)
    finally:
        engine.stop()
    return [outs[str(i)] for i in range(len(prompts))]


def test_cuda_graph_greedy_output_equals_eager(tmp_path: Path) -> None:
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 3, 64, 9)]
    eager = greedy_tokens(folder, prompts, disable_cuda_graph=True)
    graphed = greedy_tokens(folder, prompts)
    assert graphed == eager
