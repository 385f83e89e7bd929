"""The GPU fast path: the Triton decode kernel matches the reference, and CUDA graphs change no token.

Runs only where CUDA is (an H200, say); CI has no GPU and skips it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from engine_checkpoints import write

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.layers.attention import decode_attention_reference
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# Splits: the batch's default (7 or 17 here), one (the kernel writes the output itself, no merge), three;
# programs ordered by sequence or by KV head first.
SPLIT_LAUNCHES = [(None, None), (1, None), (1, (64, 4, 3, True)), (3, (32, 4, 2, True))]


@pytest.mark.parametrize("splits,launch", SPLIT_LAUNCHES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(32, 8, 128, 16), (6, 2, 16, 4), (28, 4, 128, 16),
                                                               (8, 8, 64, 1)])
def test_triton_paged_decode_matches_reference(heads: int, kv_heads: int, head_dim: int, page_size: int,
                                               splits: int | None, launch: tuple | None) -> None:
    from splitserve.engine.layers.paged_decode_triton import paged_decode_attention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    num_pages, max_pages, bsz = 600, 160, 5
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randint(1, num_pages, (bsz + 1, max_pages), device=dev, dtype=torch.int32)
    slots = torch.tensor([3, 0, 4, 1, 2], device=dev)
    cap = max_pages * page_size
    seq_lens = torch.tensor([1, 7, min(100, cap), min(1000, cap), min(2500, cap)], device=dev)
    q = torch.randn(bsz, heads, head_dim, device=dev, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, page_table, slots, seq_lens, page_size, scale, launch=launch,
                                 splits=splits)
    want = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), page_table, slots, seq_lens,
                                      page_size, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_fused_add_rmsnorm_matches_torch() -> None:
    from splitserve.engine.layers.fused_triton import add_rmsnorm

    torch.manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, res = add_rmsnorm(x, w, 1e-5, r)
    want_res = x + r
    xf = want_res.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    assert (out != want).float().mean() < 0.01  # rounds where torch rounds: almost every element identical


def test_fused_silu_and_mul_matches_torch() -> None:
    from splitserve.engine.layers.fused_triton import silu_and_mul

    gu = torch.randn(19, 2 * 3000, device="cuda", dtype=torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(gu)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01


def test_fused_rope_and_kv_store_match_torch() -> None:
    from splitserve.engine.layers.attention import store_kv
    from splitserve.engine.layers.fused_triton import rope_and_store_kv
    from splitserve.engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, dim, tokens = 32, 8, 128, 23
    rope = RotaryEmbedding(dim, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}).cuda()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 4000, (tokens,), device="cuda")
    loc = torch.randperm(200, device="cuda")[:tokens]
    caches = [torch.zeros(200, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim))
    store_kv(caches[0], caches[1], loc, k_ref, v.reshape(tokens, kv_heads, dim))
    rope_and_store_kv(qkv, positions, rope.cos, rope.sin, heads, kv_heads, dim, caches[2], caches[3], loc)
    torch.testing.assert_close(qkv[:, : heads * dim].reshape(tokens, heads, dim), q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[2], caches[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("rows", [1, 7, 256, 300])
def test_fused_decode_inputs_match_the_torch_index_arithmetic(rows: int) -> None:
    from splitserve.engine.runner.forward_batch import decode_batch

    gen = torch.Generator().manual_seed(rows)
    slots = torch.randint(0, 9, (rows,), generator=gen)
    positions = torch.randint(0, 16 * 12, (rows,), generator=gen)
    ids = torch.randint(-1, 50, (rows,), generator=gen)  # -1: the relay's token
    page_table = torch.randint(0, 1000, (10, 12), generator=gen, dtype=torch.int32)
    relay = torch.randint(0, 50, (10,), generator=gen)
    for r in (relay, None):
        want = decode_batch(ids, positions, slots, page_table, 16, r)  # the torch path, on the CPU
        got = decode_batch(ids.cuda(), positions.cuda(), slots.cuda(), page_table.cuda(), 16,
                           r.cuda() if r is not None else None)
        for name in ("input_ids", "out_cache_loc", "seq_lens", "logits_index"):
            assert getattr(got, name).dtype == torch.int64
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


def greedy_tokens(folder: Path, prompts: list[list[int]], **cfg) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4,
                                 max_total_tokens=8192, max_running_requests=16, **cfg))
    engine.start()
    try:
        # All at once: every mode then runs the same steps (one prefill step, then decodes of every
        # request), so any difference is the graphs' or the relay's. Arrival times would change
        # who shares a step, and bf16 kernels are not batch-invariant across every path (cuBLAS
        # picks kernels by row count), so staggered arrivals may differ in late tokens legitimately.
        return generate_tokens(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
                               timeout=120)
    finally:
        engine.stop()


@pytest.mark.parametrize("lengths", [(1, 5, 17, 40, 3, 64, 9), (33,)])
def test_cuda_graphs_and_overlap_change_no_greedy_token(tmp_path: Path, lengths: tuple[int, ...]) -> None:
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    eager = greedy_tokens(folder, prompts, disable_cuda_graph=True, disable_overlap=True)
    graphed = greedy_tokens(folder, prompts, disable_overlap=True)
    overlapped = greedy_tokens(folder, prompts)  # graphs + the overlap scheduler, the GPU default
    assert graphed == eager
    assert overlapped == eager


def test_graphs_with_seeded_sampling_and_one_token_prompt_chunks_match_eager(tmp_path: Path) -> None:
    # Seeded rows are sampled on the host side of the step after the graph wrote its argmax to
    # the relay; chunks of 2 give steps of one-token chunks where a prompt row samples nothing.
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 7, 5, 12)]

    def run(**cfg) -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4,
                                     max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=2, **cfg))
        engine.start()
        try:
            greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
            seeded = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
            with ThreadPoolExecutor(2) as pool:  # greedy and seeded rows share steps
                both = pool.submit(generate_tokens, engine, prompts[:2], greedy, 120)
                seeded_out = pool.submit(generate_tokens, engine, prompts[2:], seeded, 120)
                return [*both.result(), *seeded_out.result()]
        finally:
            engine.stop()

    assert run() == run(disable_cuda_graph=True, disable_overlap=True)


@pytest.mark.parametrize("splits,launch", SPLIT_LAUNCHES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(32, 8, 128, 16), (6, 2, 16, 4), (8, 8, 64, 1)])
def test_decode_kernel_with_the_new_token_matches_rope_store_then_reference(heads: int, kv_heads: int, head_dim: int,
                                                                            page_size: int, splits: int | None,
                                                                            launch: tuple | None) -> None:
    from splitserve.engine.layers.attention import store_kv
    from splitserve.engine.layers.paged_decode_triton import NewTokenKV, paged_decode_attention
    from splitserve.engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    dev = torch.device("cuda")
    bsz, max_pages = 5, 160
    num_pages = (bsz + 1) * max_pages + 1
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    # Pages owned by one sequence each: the new token's KV lands where nobody else reads.
    page_table = (torch.randperm(num_pages - 1, device=dev)[: (bsz + 1) * max_pages] + 1).view(bsz + 1, -1).int()
    slots = torch.tensor([3, 0, 4, 1, 2], device=dev)
    cap = max_pages * page_size
    seq_lens = torch.tensor([1, 7, min(100, cap), min(1000, cap), min(2500, cap)], device=dev)
    positions = seq_lens - 1
    loc = page_table[slots, positions // page_size].long() * page_size + positions % page_size
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None).to(dev)
    qkv = torch.randn(bsz, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.view(bsz, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                               kv_heads * head_dim], dim=-1))
    q_ref, k_ref = (t.to(torch.bfloat16) for t in rope(positions, q, k))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    store_kv(k_want, v_want, loc, k_ref, v)
    scale = head_dim ** -0.5
    want = decode_attention_reference(q_ref.float(), k_want.float(), v_want.float(), page_table, slots, seq_lens,
                                      page_size, scale)
    got = paged_decode_attention(q, k_cache, v_cache, page_table, slots, seq_lens, page_size, scale,
                                 NewTokenKV(k, v, rope.cos, rope.sin, loc), launch=launch, splits=splits)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache, k_want, atol=2e-2, rtol=2e-2)
    assert torch.equal(v_cache, v_want)


def test_triton_argmax_matches_torch_with_ties_to_the_first_index() -> None:
    from splitserve.engine.sampling.argmax_triton import argmax_rows

    torch.manual_seed(0)
    logits = torch.randn(6, 128256, device="cuda")
    logits[0, 70000] = logits[0, 90000] = 100.0  # a tie across chunks
    logits[1, 5] = logits[1, 9] = 100.0  # a tie within a chunk
    logits[2, -1] = 100.0  # the last, partial chunk
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits).tolist()[:3] == [70000, 5, 128255]
    assert argmax_rows(logits[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_argmax_takes_nan_as_the_largest_value_as_torch_does(dtype: torch.dtype) -> None:
    # Compared as NaN, a row of NaN logits (a step gone wrong) gave an index past the vocabulary, and the next
    # step's embedding read out of bounds: a device-side assert that ended every request of the engine.
    from splitserve.engine.sampling.argmax_triton import argmax_rows

    vocab = 128256
    logits = torch.randn(5, vocab, device="cuda").to(dtype)
    logits[0] = float("nan")
    logits[1, 7] = float("nan")
    logits[2, vocab - 3] = float("nan")  # in the last, partial chunk
    logits[3, 5000:] = float("nan")
    got = argmax_rows(logits)
    assert got.tolist()[:4] == [0, 7, vocab - 3, 5000]
    assert torch.equal(got, logits.argmax(dim=-1))


def test_argmax_of_bfloat16_logits_is_the_argmax_of_their_float32_copy() -> None:
    # Decode graphs take the argmax of the LM head's bfloat16 logits, not of the float32 copy.
    from splitserve.engine.sampling.greedy import argmax_tokens

    torch.manual_seed(1)
    logits = torch.randn(256, 128256, device="cuda").to(torch.bfloat16)
    logits[0, 70000] = logits[0, 90000] = 30.0  # ties, which bfloat16 makes common
    logits[1, 7] = logits[1, 4100] = 30.0
    assert torch.equal(argmax_tokens(logits), argmax_tokens(logits.float()))
    assert argmax_tokens(logits).tolist()[:2] == [70000, 7]


@pytest.mark.parametrize("rows", [1, 5, 16, 40, 160])
@pytest.mark.parametrize("n,k", [(96, 64), (6144, 4096), (4096, 14336)])
def test_skinny_gemm_matches_torch_and_a_row_does_not_depend_on_the_others(rows: int, n: int, k: int) -> None:
    from splitserve.engine.layers import skinny

    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    weight = torch.randn(n, k, **bf16) / k**0.5
    bias = torch.randn(n, **bf16)
    x = torch.randn(rows, k, **bf16)
    y = skinny.skinny_linear(x, weight, bias)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias), atol=3e-2, rtol=2e-2)
    # Batch invariance: row 0 alone gives the same bits as row 0 among the others.
    assert torch.equal(skinny.skinny_linear(x[:1], weight, bias), y[:1])


LLAMA_8B_PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.parametrize("n,k", LLAMA_8B_PROJECTIONS, ids=["qkv", "o_proj", "gate_up", "down", "lm_head"])
def test_a_row_invariant_row_has_the_same_bits_at_every_row_count_from_1_to_300(n: int, k: int) -> None:
    """The row-invariant path of a layer whose limit is 300 rows (the skinny kernel up to 32 rows, the
    wide kernel's launch per row count past them) gives a row the same bits whatever the row count and
    its place among the rows: 1..300 rows from the first, and slices that start inside a tile,
    against the 300-row product."""
    from splitserve.engine.layers import skinny
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    weight = torch.randn(n, k, **bf16) / k**0.5
    x = torch.randn(300, k, **bf16)

    def path(rows: torch.Tensor) -> torch.Tensor:
        return skinny.skinny_linear(rows, weight, max_rows=300)

    y = path(x)
    torch.testing.assert_close(y.double(), x.double() @ weight.double().T, atol=2e-2, rtol=2e-2)
    differ = [m for m in range(1, 301) if not torch.equal(path(x[:m]), y[:m])]
    moved = [(start, m) for start, m in ((7, 1), (7, 25), (37, 40), (5, 96), (100, 160), (12, 288))
             if not torch.equal(path(x[start:start + m]), y[start:start + m])]
    skinny_vs_wide = int((skinny_gemm(x[:32], weight) != y[:32]).sum())
    print(f"\n{n} x {k}: row counts whose rows differ from the 300-row product: {differ or 'none'}; "
          f"slices: {moved or 'none'}; skinny kernel's 32 rows vs the path's: {skinny_vs_wide} values differ "
          f"(skinny kernel {'up to 32 rows' if skinny.SKINNY_MATCHES_WIDE else 'unused'} here)")
    assert not differ and not moved


# Wide-tile launches: 64-row tiles, 128-row tiles with K in two slices, narrow tiles with K in two slices.
WIDE_LAUNCHES = [(64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 2), (64, 64, 128, 4, 4, 2)]


@pytest.mark.parametrize("launch", WIDE_LAUNCHES)
@pytest.mark.parametrize("rows", [33, 200, 512])
@pytest.mark.parametrize("n,k", [(96, 256), (4096, 14336)])
def test_wide_gemm_matches_torch_and_gives_the_same_bits_every_run(rows: int, n: int, k: int, launch: tuple) -> None:
    from splitserve.engine.layers.wide_gemm_triton import WideLaunch, wide_gemm

    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    weight = torch.randn(n, k, **bf16) / k**0.5
    bias = torch.randn(n, **bf16)
    x = torch.randn(rows, k, **bf16)
    y = wide_gemm(x, weight, bias, WideLaunch(*launch))
    torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias), atol=3e-2, rtol=2e-2)
    assert torch.equal(wide_gemm(x, weight, bias, WideLaunch(*launch)), y)  # the slices summed in one order


def causal_chunk_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           slot: int, kv_len: int, page_size: int, scale: float) -> torch.Tensor:
    """One chunk's queries q [L, H, D] (the last L of its kv_len tokens) over its paged KV, in float64."""
    pos = torch.arange(kv_len, device=q.device)
    loc = page_table[slot, pos // page_size].long() * page_size + pos % page_size
    keys, values = k_cache[loc].double(), v_cache[loc].double()  # [kv_len, Hkv, D]
    group = q.shape[1] // k_cache.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    q_pos = torch.arange(kv_len - q.shape[0], kv_len, device=q.device)
    scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def random_paged_step(lengths: list[int], kv_lens: list[int], slots: list[int], heads: int, kv_heads: int,
                      head_dim: int, page_size: int, dtype: torch.dtype, device: str = "cuda"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's random queries [sum(lengths), H, D] over random paged KV: each slot's pages shuffled
    across the pool (page 0 left as scratch), two spare page-table rows of scratch pages."""
    max_pages = -(-max(kv_lens) // page_size)
    num_pages = len(slots) * max_pages + 1
    page_table = (torch.randperm(num_pages - 1, device=device) + 1)[: len(slots) * max_pages].view(len(slots), -1)
    page_table = torch.cat([page_table, torch.zeros(2, max_pages, dtype=page_table.dtype, device=device)]).int()
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(lengths), heads, head_dim, device=device, dtype=dtype)
    return page_table, k_cache, v_cache, q


def assert_rows_match_float64(got: torch.Tensor, q: torch.Tensor, lengths: list[int], kv_lens: list[int],
                              slots: list[int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                              page_table: torch.Tensor, page_size: int, tol: float) -> None:
    """Every sequence's rows of a step's attention output `got` [T, H, D] close to its float64 reference."""
    assert torch.isfinite(got).all()
    row = 0
    for length, kv_len, slot in zip(lengths, kv_lens, slots, strict=True):
        want = causal_chunk_reference(q[row:row + length], k_cache, v_cache, page_table, slot, kv_len, page_size,
                                      q.shape[2] ** -0.5).float()
        torch.testing.assert_close(got[row:row + length], want, atol=tol, rtol=tol)
        row += length


def paged_extend_batch(q: torch.Tensor, lengths: list[int], kv_lens: list[int], slots: list[int],
                       page_table: torch.Tensor, page_size: int, group: int, wide: bool, decode_rows: int,
                       long_chunks: list | None = None, long_chunk_loc: torch.Tensor | None = None):
    """The ForwardBatch of an extend step over `random_paged_step`'s rows: `decode_rows` decode rows first,
    then chunks (those in `long_chunks` through cuDNN), planned as the runner plans them."""
    from splitserve.engine.layers.extend_plan import block_tokens, extend_plan_values, padded
    from splitserve.engine.runner.forward_batch import ForwardBatch

    long_rows = frozenset(c.row for c in long_chunks or [])
    plan, chunks, blocks = extend_plan_values(lengths, kv_lens, slots, block_tokens(group, wide), decode_rows,
                                              long_rows)
    meta = torch.tensor(padded(slots[:decode_rows]) + padded(kv_lens[:decode_rows]) + plan, dtype=torch.int32,
                        device=q.device)
    return ForwardBatch(input_ids=q.new_zeros(q.shape[0], dtype=torch.long), positions=q.new_zeros(1),
                        out_cache_loc=q.new_zeros(1), seq_lens=torch.tensor(kv_lens, device=q.device),
                        logits_index=q.new_zeros(1), attn_meta=meta, decode_rows=decode_rows, extend_chunks=chunks,
                        extend_blocks=blocks, prefix_chunks=tuple(long_chunks or ()), prefix_chunk_loc=long_chunk_loc,
                        page_table=page_table, page_size=page_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(32, 8, 128, 16), (6, 2, 16, 4), (28, 4, 128, 16),
                                                               (8, 8, 64, 1)])
def test_paged_extend_and_decode_rows_match_float64(heads: int, kv_heads: int, head_dim: int, page_size: int,
                                                    dtype: torch.dtype) -> None:
    # Decode rows first (the paged decode kernel), then chunks: no prefix, over a prefix, one token,
    # one longer than a program's block; every row written, each close to float64.
    from splitserve.engine.layers.attention import PagedAttention
    from splitserve.engine.layers.extend_plan import wide_tiles

    torch.manual_seed(0)
    lengths = [1, 1, 37, 130, 1, 300]
    kv_lens = [5, 900, 37, 530, 64, 300]
    slots = [4, 0, 2, 5, 1, 3]
    page_table, k_cache, v_cache, q = random_paged_step(lengths, kv_lens, slots, heads, kv_heads, head_dim,
                                                        page_size, dtype)
    batch = paged_extend_batch(q, lengths, kv_lens, slots, page_table, page_size, heads // kv_heads,
                               wide_tiles(head_dim, dtype.itemsize), decode_rows=2)
    attn = PagedAttention(heads, kv_heads, head_dim, 0)
    got = attn._paged_extend(q, batch, k_cache, v_cache).float()
    assert_rows_match_float64(got, q, lengths, kv_lens, slots, k_cache, v_cache, page_table, page_size,
                              2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(32, 8, 128, 16), (6, 2, 16, 4), (28, 4, 128, 16),
                                                               (8, 8, 64, 1)])
def test_long_chunks_through_cudnn_beside_the_paged_kernels_match_float64(heads: int, kv_heads: int, head_dim: int,
                                                                         page_size: int, dtype: torch.dtype) -> None:
    # A decode row, a fresh prompt, a short chunk over a prefix and a full chunk over a prefix that is not
    # whole chunks through the Triton kernels; two full chunks after whole chunks (of 256 here) through
    # cuDNN, merged by their log-sum-exps. Every row close to float64.
    from splitserve.engine.layers.attention import PagedAttention
    from splitserve.engine.layers.extend_plan import prefix_chunks
    from splitserve.engine.runner.model_runner import kv_locations

    torch.manual_seed(0)
    lengths = [1, 300, 256, 37, 256, 256]
    kv_lens = [900, 300, 1792, 537, 512, 1000]
    slots = [4, 0, 2, 5, 1, 3]
    page_table, k_cache, v_cache, q = random_paged_step(lengths, kv_lens, slots, heads, kv_heads, head_dim,
                                                        page_size, dtype)
    decode_rows = 1
    long_chunks = prefix_chunks(lengths, kv_lens, 256, decode_rows)
    assert [c.index for c in long_chunks] == [2, 4]
    loc = torch.cat([kv_locations(page_table.long(), slots[c.index], c.kv_len, page_size) for c in long_chunks])
    batch = paged_extend_batch(q, lengths, kv_lens, slots, page_table, page_size, heads // kv_heads, False,
                               decode_rows, long_chunks, loc)
    assert batch.extend_chunks == 3
    got = PagedAttention(heads, kv_heads, head_dim, 0)._paged_extend(q, batch, k_cache, v_cache).float()
    assert_rows_match_float64(got, q, lengths, kv_lens, slots, k_cache, v_cache, page_table, page_size, 2e-2)


@torch.inference_mode()
def test_a_long_prompt_chunked_through_cudnn_gives_the_logits_of_the_triton_path_and_of_one_chunk(
        tmp_path: Path) -> None:
    # 3072 tokens in chunks of 1024 (the second and third after 1024 and 2048 cached tokens: the cuDNN
    # path), through the paged extend kernel instead, and as one fresh prompt: every position's logits agree
    # to bf16 rounding. Also the cuDNN graphs the warm-up builds for this context.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.layers.extend_plan import cudnn_prefixes
    from splitserve.engine.layers.prefix_chunk_attention import build_cudnn_graphs
    from splitserve.engine.request import Request
    from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
    from splitserve.engine.scheduler import ScheduledChunk

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096}, 1234)
    cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192,
                       max_running_requests=4)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    assert runner.cudnn_chunk == 2048  # the engine's chunk
    build_cudnn_graphs(2048, cudnn_prefixes(2048, 4096), 6, 2, 16, torch.bfloat16, runner.device)
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 4096, runner.device)
    prompt = torch.randint(0, 256, (3072,), generator=torch.Generator().manual_seed(0)).tolist()
    req = Request("r", prompt, SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    assert kv.grow(req, len(prompt))

    def logits(chunk: int, cudnn: bool) -> tuple[torch.Tensor, int]:
        out, through_cudnn = [], 0
        for start in range(0, len(prompt), chunk):
            batch = build_forward_batch([ScheduledChunk(req, start, chunk, True)], kv.page_table, kv.page_size,
                                        runner.device, tokens_per_block=runner.extend_block_tokens,
                                        cudnn_chunk=1024 if cudnn else None)
            batch.logits_index = torch.arange(chunk, device=runner.device)
            out.append(runner.model(batch, runner.kv_pool).float())
            through_cudnn += len(batch.prefix_chunks)
        return torch.cat(out), through_cudnn

    cudnn, n_cudnn = logits(1024, True)
    triton, n_triton = logits(1024, False)
    whole, _ = logits(3072, True)
    assert (n_cudnn, n_triton) == (2, 0)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    assert rel(cudnn, whole) < 2e-2 and rel(triton, whole) < 2e-2 and rel(cudnn, triton) < 2e-2
    assert torch.isfinite(cudnn).all()


def test_mixed_steps_through_the_paged_kernels_give_the_reference_paths_greedy_tokens(tmp_path: Path) -> None:
    # float32, chunks of 8: prompt chunks over cached prefixes beside decode rows in most steps. The
    # reference path gathers every sequence's KV padded to the longest and runs one masked SDPA.
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 29, 12, 50, 1, 17)]

    def run(paged: bool) -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32", page_size=4,
                                     max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=8))
        if not paged:
            engine.runner.extend_block_tokens = None
        engine.start()
        try:
            return generate_tokens(engine, prompts, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                   ignore_eos=True), timeout=120)
        finally:
            engine.stop()

    assert run(paged=True) == run(paged=False)


def test_a_stopped_engine_gives_its_gpu_memory_back_and_a_second_one_starts(tmp_path: Path) -> None:
    folder = write("llama-gqa-llama3rope", tmp_path)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    left = []
    outputs = []
    for _ in range(2):  # KV sized from --mem-fraction: the second fits only if the first gave it back
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", max_running_requests=4))
        engine.start()
        try:
            outputs.append(generate_tokens(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                                ignore_eos=True), timeout=60))
        finally:
            engine.stop()
        del engine
        left.append(torch.cuda.memory_allocated() - before)
    assert outputs[0] == outputs[1]
    # What stays is cuBLAS's workspaces: the engine thread's handle gets one per stream it runs on (its own and the
    # one every graph capture shares), 32 MiB each on an H200, and torch keeps them for the process; a second engine
    # reuses them (before the capture stream was shared, every engine left 64 MiB more: stop_memory_h200_s9.txt).
    assert left[0] < 96 << 20 and left[1] - left[0] < 1 << 20, left


def test_samples_that_copy_their_prompt_s_last_page_on_the_gpu_match_computing_it(tmp_path: Path) -> None:
    # Same prompts four times each, all at once: with the prefix cache on, samples 2..4 share the
    # first one's full pages and take its partial last page (or, on a page boundary, the last full
    # page) by a device copy on the engine's stream, running only their last token; float32 so a
    # cached prefix changes no bit. Graphs and the overlap scheduler stay on (the GPU default).
    folder = write("llama-gqa-llama3rope", tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (14, 12, 3)]
    repeated = [p for p in prompts for _ in range(4)]

    def run(**cfg) -> tuple[list[list[int]], float]:
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32", page_size=4,
                                     max_total_tokens=4096, max_running_requests=16, **cfg))
        engine.start()
        try:
            out = generate_tokens(engine, repeated, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                   ignore_eos=True), timeout=120)
            computed = engine.metrics.registry.get_sample_value("splitserve_prompt_tokens_computed_total",
                                                                {"model": engine.metrics.model_name})
            deadline = time.monotonic() + 10  # the last release runs on the engine thread after the output
            while engine.kv.usage().used_by_requests and time.monotonic() < deadline:
                time.sleep(0.01)
            usage = engine.kv.usage()
            assert (usage.used_by_requests, usage.locked, usage.slots_in_use) == (0, 0, 0)
            return out, computed
        finally:
            engine.stop()

    copied, copied_computed = run()
    computed, computed_computed = run(disable_prefix_cache=True)
    assert computed_computed == 4 * (14 + 12 + 3)
    assert copied_computed == 14 + 12 + 3 + 3 * 3  # later samples ran one token each
    assert copied == computed
    assert all(copied[i] == copied[i - i % 4] for i in range(len(copied)))


def lone_prompt_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, H, D] causal attention of one fresh prompt in float64 (GQA by head grouping)."""
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.double().transpose(0, 1).unsqueeze(0)
    out = torch.nn.functional.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                                           is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (6, 2, 16)])
@pytest.mark.parametrize("length", [1, 97, 256, 300, 1000, 2047])
def test_a_lone_prompt_padded_to_its_cudnn_bucket_gives_the_unpadded_cudnn_rows(heads: int, kv_heads: int,
                                                                                  head_dim: int, length: int) -> None:
    # The prompt's q, k, v padded at the end to the next multiple of 256: the real rows are the unpadded
    # cuDNN call's to bf16 rounding (and close to float64); past the last bucket, flash attention, as close.
    # The one pad of the packed projection and the pad of q, k, v concatenated give the same bits, and the
    # real rows do not change by a bit with garbage in the padded rows (cuDNN's causal mask is top-left).
    from splitserve.engine.layers.cudnn_attention import cudnn_attention
    from splitserve.engine.layers.prompt_attention import (
        cudnn_at_bucket,
        lone_prompt_attention,
        padded_projection,
        prompt_bucket,
    )

    torch.manual_seed(length)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, **bf16)  # q, k, v views of the projection, as served
    q, k, v = (t.view(length, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], dim=1))
    scale = head_dim ** -0.5
    bucket = prompt_bucket(length, 2048)
    assert bucket is not None and bucket % 256 == 0 and bucket - 256 < length <= bucket
    got = cudnn_at_bucket(q, k, v, scale, bucket, qkv)
    assert got.shape == (length, heads, head_dim)
    assert torch.equal(cudnn_at_bucket(q, k, v, scale, bucket), got)  # q, k, v concatenated, then padded
    if length < bucket:
        garbage = padded_projection(q, k, v, bucket, qkv)
        garbage[length:] = torch.randn(bucket - length, garbage.shape[1], **bf16) * 100
        pq, pk, pv = (t.view(bucket, -1, head_dim) for t in garbage.split([heads * head_dim, kv_heads * head_dim,
                                                                           kv_heads * head_dim], dim=1))
        assert torch.equal(cudnn_attention(pq, pk, pv, scale, causal=True)[0][:length], got)
    want = lone_prompt_float64(q, k, v, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    if length > 1:  # the unpadded call at the prompt's own length (a graph of its own)
        unpadded = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), None,
            False, 0.0, True, False, scale=scale)[0].squeeze(0).transpose(0, 1)
        torch.testing.assert_close(got.float(), unpadded.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lone_prompt_attention(q, k, v, scale, 2048, qkv), got)  # the bucket path
    flash = lone_prompt_attention(q, k, v, scale, 0)  # no bucket: flash attention
    torch.testing.assert_close(flash.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("length", [4097, 6000, 8192])
def test_a_lone_prompt_past_the_fine_buckets_attends_through_cudnn_at_its_long_bucket(
        length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Past BUCKET_MAX a lone prompt is padded to a quarter-octave bucket (its cuDNN graph built on first use), not
    # sent to flash attention; its rows are flash attention's to bf16 rounding.
    from splitserve.engine.layers import prompt_attention

    padded_to: list[int] = []
    real = prompt_attention.cudnn_at_bucket

    def cudnn_spy(q, k, v, scale, bucket, qkv=None):
        padded_to.append(bucket)
        return real(q, k, v, scale, bucket, qkv)

    monkeypatch.setattr(prompt_attention, "cudnn_at_bucket", cudnn_spy)
    torch.manual_seed(length)
    heads, kv_heads, head_dim = 32, 8, 128
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(length, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], dim=1))
    scale = head_dim ** -0.5
    got = prompt_attention.lone_prompt_attention(q, k, v, scale, prompt_attention.BUCKET_MAX, qkv)
    assert padded_to == [prompt_attention.long_prompt_bucket(length)] and got.shape == (length, heads, head_dim)
    flash = prompt_attention.flash_attention(q, k, v, scale)
    torch.testing.assert_close(got.float(), flash.float(), atol=2e-2, rtol=2e-2)


@torch.inference_mode()
def test_after_warm_up_a_lone_prompt_of_a_new_length_takes_its_bucket_and_one_past_the_buckets_flash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunked prefill off, a 4096-token context: the warm-up builds the buckets 256..3840 (a warm-up prompt
    # is at most context - 64 tokens); a 333-token prompt then attends at 512 through cuDNN, a 3900-token one
    # through flash attention (no graph of its length exists), and the logits of both are the default
    # SDPA dispatch's to bf16 rounding. Which function ran is recorded by wrapping the real ones.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.layers import prompt_attention
    from splitserve.engine.request import Request
    from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
    from splitserve.engine.scheduler import ScheduledChunk

    ran: list[tuple[str, int, int]] = []  # (function, prompt length, padded length)
    cudnn_at_bucket, flash_attention = prompt_attention.cudnn_at_bucket, prompt_attention.flash_attention

    def cudnn_spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bucket: int,
                  qkv: torch.Tensor | None = None) -> torch.Tensor:
        ran.append(("cudnn", q.shape[0], bucket))
        assert qkv is not None and qkv.data_ptr() == q.data_ptr()  # the layer passes its projection
        return cudnn_at_bucket(q, k, v, scale, bucket, qkv)

    def flash_spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ran.append(("flash", q.shape[0], q.shape[0]))
        return flash_attention(q, k, v, scale)

    monkeypatch.setattr(prompt_attention, "cudnn_at_bucket", cudnn_spy)
    monkeypatch.setattr(prompt_attention, "flash_attention", flash_spy)
    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096}, 1234)
    cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=16384,
                       max_running_requests=4, chunked_prefill_size=0, prompt_graph_tokens=0)  # the eager route
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    assert runner.prompt_buckets is None  # nothing built yet: the default dispatch
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 4096, runner.device)
    runner.warm_up(kv.page_table)
    assert runner.prompt_buckets == 3840
    assert {padded for name, _, padded in ran if name == "cudnn"} == set(range(256, 3841, 256))
    assert all(name == "cudnn" for name, _, _ in ran)
    gen = torch.Generator().manual_seed(0)
    for length, route in ((333, ("cudnn", 333, 512)), (3900, ("flash", 3900, 3900))):
        ran.clear()
        req = Request(f"r{length}", torch.randint(0, 256, (length,), generator=gen).tolist(),
                      SamplingParams(max_new_tokens=1, temperature=0.0), on_output=lambda _o: None)
        kv.admit(req, max_prefix_tokens=0)
        assert kv.grow(req, length)
        runner.run([ScheduledChunk(req, 0, length, True)], kv.page_table)
        assert set(ran) == {route}  # every layer, one function

        def logits(buckets: int | None, req: Request = req, length: int = length) -> torch.Tensor:
            batch = build_forward_batch([ScheduledChunk(req, 0, length, True)], kv.page_table, kv.page_size,
                                        runner.device, tokens_per_block=runner.extend_block_tokens,
                                        cudnn_chunk=runner.cudnn_chunk, prompt_buckets=buckets)
            batch.logits_index = torch.arange(length, device=runner.device)
            return runner.model(batch, runner.kv_pool).float()

        bucketed, default = logits(runner.prompt_buckets), logits(None)
        assert torch.isfinite(bucketed).all()
        assert float((bucketed - default).norm() / default.norm()) < 2e-2
        kv.release(req, cache_prefix=False)


@torch.inference_mode()
def test_with_sdpas_cudnn_backend_off_the_warm_up_builds_no_bucket(tmp_path: Path) -> None:
    # As in a drafter with --no-drafter-cudnn-attention: lone prompts keep SDPA's default dispatch.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096}, 1234)
    cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192,
                       max_running_requests=4)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 4096, runner.device)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        runner.warm_up(kv.page_table)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert runner.prompt_buckets is None
    runner.warm_up(kv.page_table)  # cuDNN on: the default 2048-token budget's 8 buckets
    assert runner.prompt_buckets == 2048
