"""Speculative decoding on the GPU: a verify step's rows are computed with plain decoding's numerics.

A verify step runs each request's K+1 positions as decode rows (the paged decode kernel, the
split count of plain decoding's batch, the row-invariant projections), through CUDA graphs. Every
row count gives a row the same bits, float32 and bfloat16 (here 16-bit projections of up to 288
rows take the row-invariant path, the skinny kernel to 32 rows and the wide kernel past them, not
cuBLAS, which rounds by row count; the engine's default is 32), so greedy output with drafts is
plain decoding's at every batch size (`-s` prints how many requests match). In the first tests
the oracle's requests all advance alike (each step every request accepts as many drafts), so each
position is computed in a batch of the same size as in plain decoding: the decode attention's split
count depends on the batch. The last ones let requests advance at different rates (other lengths,
other K, wrong drafts for some), so that their late positions are computed beside other requests
than in plain decoding, in batch-invariant mode (`--batch-invariant`: the row-invariant path up to
the largest verify step, one attention split count at every batch: engine/layers/decode_splits.py),
and check a row's attention bits alone and in a batch.

Runs only where CUDA is (an H200, say); CI has no GPU and skips it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from splitserve.bench.spec import SPEC_CPU, spec_checkpoints
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import generate_tokens
from splitserve.engine.request import Request, RequestStatus, TokenOutput
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OUTPUT_LEN = 32


class OracleDrafts(Role):
    """Offers each decoding request the next K tokens of its plain continuation, every
    `wrong_every`-th one replaced by a wrong token; K = 0 offers nothing (plain decoding).
    `plans` gives a request (by prompt) its own (K, wrong_every) while K > 0."""

    def __init__(self, max_k: int, batch_invariant: bool = False) -> None:
        self.max_k, self.k, self.wrong_every = max_k, 0, 0
        self.batch_invariant = batch_invariant
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.plans: dict[tuple[int, ...], tuple[int, int]] = {}

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        # 16-bit projections of up to 32 x (K + 1) rows on the row-invariant path; batch-invariant mode
        # derives that count itself (max_running_requests x (K + 1)).
        rows = None if self.batch_invariant else 32 * (self.max_k + 1)
        engine.prepare_speculation(self.max_k, row_invariant_rows=rows, batch_invariant=self.batch_invariant)

    def allows_overlap(self) -> bool:
        return not self.k  # a draft follows a token known on the host

    def poll(self) -> None:
        if not self.k:
            return
        for req in self.engine.requests.values():
            if req.status is not RequestStatus.RUNNING or req.pending_len != 1 or not req.output_ids:
                continue
            n = len(req.output_ids)
            k, wrong_every = self.plans.get(tuple(req.prompt_ids), (self.k, self.wrong_every))
            rest = self.continuations[tuple(req.prompt_ids)][n:n + k]
            if wrong_every:
                rest = [(t + 1) % 300 if (n + i) % wrong_every == 0 else t for i, t in enumerate(rest)]
            req.draft_tokens = rest


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return spec_checkpoints(SPEC_CPU, tmp_path_factory.mktemp("spec-gpu"), 4, 0, "cuda")["target"]


def prompts_for(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randint(0, 300, (int(n),), generator=gen).tolist()
            for n in torch.randint(8, 60, (batch,), generator=gen)]


def runs_with_drafts(target: Path, dtype: str, batch: int, **cfg) -> tuple[list[list[int]], dict[str, list]]:
    """Plain greedy output, then the outputs with right drafts (K=4) and with every third draft
    wrong (K=8), all on one engine; asserts the drafts were verified and every page came back."""
    oracle = OracleDrafts(max_k=8)
    # No prefix cache: a later run's prompt would be a cached prefix plus one extend row, not the first
    # run's causal prefill, and in bfloat16 that alone changes the first token.
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype=dtype, max_total_tokens=32768,
                                 max_running_requests=32, disable_prefix_cache=True, **cfg),
                    role=ComposedRole("unified", [oracle]))
    engine.start()
    prompts = prompts_for(batch)
    params = SamplingParams(max_new_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    try:
        start = engine.kv.usage()
        plain = generate_tokens(engine, prompts, params, timeout=300)
        oracle.continuations = {tuple(p): o for p, o in zip(prompts, plain, strict=True)}
        outputs = {}
        for k, wrong_every in ((4, 0), (8, 3)):
            oracle.k, oracle.wrong_every = k, wrong_every
            drafted = engine.metrics.spec_draft_tokens._value.get()
            accepted = engine.metrics.spec_accepted_tokens._value.get()
            outputs[f"K={k} wrong_every={wrong_every}"] = generate_tokens(engine, prompts, params, timeout=300)
            drafted = engine.metrics.spec_draft_tokens._value.get() - drafted
            accepted = engine.metrics.spec_accepted_tokens._value.get() - accepted
            assert drafted > 0 and (accepted == drafted if not wrong_every else 0 < accepted < drafted)
        usage = engine.kv.usage()
        assert usage.free + usage.cached == start.free + start.cached and usage.slots_in_use == 0
        return plain, outputs
    finally:
        engine.stop()


def match_report(plain: list[list[int]], outputs: dict[str, list]) -> str:
    parts = []
    for name, out in outputs.items():
        same = sum(a == b for a, b in zip(out, plain, strict=True))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
                  for a, b in zip(out, plain, strict=True)]
        parts.append(f"{name}: {same}/{len(plain)} requests identical, {sum(prefix)}/{sum(map(len, plain))} tokens "
                     "before the first difference")
    return "; ".join(parts)


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_float32_greedy_output_with_drafts_is_plain_decodings_at_every_batch(target: Path, batch: int) -> None:
    plain, outputs = runs_with_drafts(target, "float32", batch)
    print(f"\nfloat32 batch {batch}: {match_report(plain, outputs)}")
    for out in outputs.values():
        assert out == plain


def test_float32_eager_verify_steps_give_plain_decodings_output(target: Path) -> None:
    plain, outputs = runs_with_drafts(target, "float32", 8, disable_cuda_graph=True)
    for out in outputs.values():
        assert out == plain


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_bfloat16_greedy_output_with_drafts(target: Path, batch: int) -> None:
    plain, outputs = runs_with_drafts(target, "bfloat16", batch)
    print(f"\nbfloat16 batch {batch}: {match_report(plain, outputs)}")
    for out in outputs.values():  # up to 32 x 9 = 288 rows, all on the row-invariant kernel here
        assert out == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_attend_with_the_bits_of_one_decode_step_per_position(dtype: torch.dtype) -> None:
    from splitserve.engine.layers.paged_decode_triton import (
        NewTokenKV,
        num_splits_for,
        paged_decode_attention,
        store_rotated_kv,
    )
    from splitserve.engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    dev = torch.device("cuda")
    heads, kv_heads, head_dim, page_size, max_pages = 32, 8, 128, 16, 64
    seqs, rows, cached = 3, 5, [1, 100, 700]
    num_pages = seqs * max_pages + 1
    page_table = (torch.randperm(num_pages - 1, device=dev) + 1).view(seqs, max_pages).int()
    cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=dev, dtype=dtype)
    k_plain, v_plain = cache.clone(), torch.randn_like(cache)
    k_verify, v_verify = k_plain.clone(), v_plain.clone()
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(dev)
    q = torch.randn(seqs, rows, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(seqs, rows, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.arange(seqs, device=dev)
    positions = torch.tensor(cached, device=dev).view(-1, 1) + torch.arange(rows, device=dev).view(1, -1)
    loc = page_table[slots.view(-1, 1), positions // page_size].long() * page_size + positions % page_size
    splits = num_splits_for(seqs, kv_heads)
    scale = head_dim ** -0.5
    plain = [paged_decode_attention(q[:, j], k_plain, v_plain, page_table, slots, positions[:, j] + 1, page_size,
                                    scale, NewTokenKV(k[:, j], v[:, j], rope.cos, rope.sin, loc[:, j].contiguous()),
                                    splits=splits)
             for j in range(rows)]  # one decode step per position
    new = NewTokenKV(k.flatten(0, 1), v.flatten(0, 1), rope.cos, rope.sin, loc.flatten())
    store_rotated_kv(new, positions.flatten(), k_verify, v_verify)
    verify = paged_decode_attention(q.flatten(0, 1), k_verify, v_verify, page_table, slots.repeat_interleave(rows),
                                    positions.flatten() + 1, page_size, scale, new, splits=splits,
                                    new_kv_stored=True).view(seqs, rows, heads, head_dim)
    assert torch.equal(verify, torch.stack(plain, dim=1))
    assert torch.equal(k_verify, k_plain) and torch.equal(v_verify, v_plain)


@pytest.mark.parametrize("dtype,rows,n,k", [(torch.float32, 300, 1536, 512), (torch.bfloat16, 300, 1536, 512),
                                            (torch.bfloat16, 288, 6144, 1024), (torch.bfloat16, 160, 4096, 2048)])
def test_a_skinny_row_has_the_same_bits_at_every_row_count(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    from splitserve.engine.layers.skinny_gemm_triton import skinny_gemm

    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    y = skinny_gemm(x, weight)
    want = x.double() @ weight.double().T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)
    # 1 and 9 rows: one tile a program; 20 and 32: two; 40 and more: four
    for start, count in ((0, 1), (5, 1), (3, 9), (11, 20), (0, 32), (37, 40), (64, 96), (rows - 7, 7)):
        assert torch.equal(skinny_gemm(x[start:start + count], weight), y[start:start + count]), (start, count)


# ---- batch-invariant attention: requests that advance at different rates ----------------------


def generate_together(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                      timeout: float = 300.0) -> list[list[int]]:
    """Greedy outputs of prompts all in the engine's inbox before its next step (the loop is held
    meanwhile), so that the first step prefills them all in every run and no later step mixes a
    prompt chunk with decodes, whose rows take another path (the extend kernels)."""
    outs: dict[str, list[int]] = {f"together-{i}": [] for i in range(len(prompts))}
    errors: list[str] = []
    finished = threading.Semaphore(0)
    held, release = threading.Event(), threading.Event()

    def collect(out: TokenOutput) -> None:
        outs[out.request_id].extend(out.token_ids)
        if out.finish_reason is not None:
            if out.error:
                errors.append(out.error)
            finished.release()

    def hold() -> None:
        held.set()
        release.wait(30)

    engine.call_soon(hold)
    assert held.wait(30)
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.submit(Request(f"together-{i}", list(prompt), p, collect))
    finally:
        release.set()
    for _ in prompts:
        assert finished.acquire(timeout=timeout), "a request did not finish"
    assert not errors, errors
    return [outs[f"together-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("batch", [8, 32])
def test_bfloat16_greedy_output_with_drafts_at_different_rates_is_plain_decodings(target: Path, batch: int) -> None:
    """Requests of different lengths (8 to 40 tokens), with K = 2, 4 or 8 (each K for all of them, then
    the three mixed), half with a wrong draft every min(3, K) positions (K=2 with every third wrong
    would never offer one: its steps advance 3 positions, and the wrong ones fall on the token the
    step itself samples): with drafts they finish at other steps than
    without, so their late positions are computed beside other requests, in batches and verify steps
    of other sizes. In batch-invariant mode (every projection of up to 32 x 9 = 288 rows on the
    row-invariant path, one attention split count at every batch) greedy output is still plain
    decoding's, token for token, in every run."""
    from splitserve.engine.layers.decode_splits import batch_invariant_splits, num_splits_for

    oracle = OracleDrafts(max_k=8, batch_invariant=True)
    engine = Engine(EngineConfig(model=str(target), device="cuda", dtype="bfloat16", max_total_tokens=32768,
                                 max_running_requests=32, disable_prefix_cache=True),
                    role=ComposedRole("unified", [oracle]))
    engine.start()
    try:
        kv_heads = engine.runner.model.layers[0].self_attn.num_kv_heads
        assert engine.runner.batch_invariant_attention and engine.runner.row_invariant_rows == 32 * 9
        for requests, rows in ((1, 1), (8, 8), (32, 32), (8, 72), (32, 288)):
            assert engine.runner.decode_splits_for(requests, rows) == batch_invariant_splits(kv_heads)
        assert engine.runner.decode_splits_for(32, 289) == num_splits_for(32, kv_heads)
        prompts = prompts_for(batch)
        params = [SamplingParams(max_new_tokens=8 + (i * 13) % 33, temperature=0.0, ignore_eos=True)
                  for i in range(batch)]
        start = engine.kv.usage()
        plain = generate_together(engine, prompts, params)
        assert [len(o) for o in plain] == [p.max_new_tokens for p in params]
        oracle.continuations = {tuple(p): o for p, o in zip(prompts, plain, strict=True)}
        runs = []
        for name, ks in (("K=2", (2,)), ("K=4", (4,)), ("K=8", (8,)), ("K=2/4/8", (2, 4, 8))):
            k_of = {tuple(p): ks[i % len(ks)] for i, p in enumerate(prompts)}
            oracle.plans = {p: (k, 0 if i % 2 == 0 else min(3, k)) for i, (p, k) in enumerate(k_of.items())}
            oracle.k = 8
            drafted = engine.metrics.spec_draft_tokens._value.get()
            accepted = engine.metrics.spec_accepted_tokens._value.get()
            drafts = generate_together(engine, prompts, params)
            drafted = engine.metrics.spec_draft_tokens._value.get() - drafted
            accepted = engine.metrics.spec_accepted_tokens._value.get() - accepted
            oracle.k = 0
            runs.append((name, drafts, accepted, drafted))
        print(f"\nbfloat16 batch {batch}, different rates, batch-invariant mode: " + "; ".join(
            f"{name}: {match_report(plain, {'drafts': out})}, {a:.0f} of {d:.0f} drafts accepted"
            for name, out, a, d in runs))
        for name, drafts, accepted, drafted in runs:
            assert 0 < accepted < drafted, name  # right drafts accepted, wrong ones not
            assert drafts == plain, name
        usage = engine.kv.usage()
        assert usage.free + usage.cached == start.free + start.cached and usage.slots_in_use == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("verify_rows", [False, True])
def test_a_rows_decode_attention_bits_do_not_depend_on_its_batch(verify_rows: bool) -> None:
    """One sequence decoded alone and among 31 others of other lengths, with the batch-invariant split
    count: its output bits are the same (bfloat16; the step's new token fused, as decode steps run it,
    or stored first, as verify rows do). With plain decoding's count (32 splits alone, 2 among 32 on
    this shape) they need not be: that is printed, not asserted."""
    from splitserve.engine.layers.decode_splits import batch_invariant_splits, num_splits_for
    from splitserve.engine.layers.paged_decode_triton import NewTokenKV, paged_decode_attention, store_rotated_kv
    from splitserve.engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, head_dim, page_size, max_pages, batch = 32, 8, 128, 16, 64, 32
    num_pages = batch * max_pages + 1
    page_table = (torch.randperm(num_pages - 1, device=dev) + 1).view(batch, max_pages).int()
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(dev)
    lens = torch.randint(1, max_pages * page_size, (batch,), generator=torch.Generator().manual_seed(1)).to(dev)
    lens[5] = 700  # the sequence looked at: 700 keys (11 blocks of 64)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device=dev)
    positions = lens - 1
    loc = page_table[slots, positions // page_size].long() * page_size + positions % page_size
    scale = head_dim ** -0.5

    def attend(rows: torch.Tensor, splits: int) -> torch.Tensor:
        kc, vc = k_cache.clone(), v_cache.clone()
        new = NewTokenKV(k[rows], v[rows], rope.cos, rope.sin, loc[rows])
        if verify_rows:
            store_rotated_kv(new, positions[rows], kc, vc)
        return paged_decode_attention(q[rows], kc, vc, page_table, slots[rows], lens[rows], page_size, scale, new,
                                      splits=splits, new_kv_stored=verify_rows)

    alone, everyone = torch.tensor([5], device=dev), torch.arange(batch, device=dev)
    splits = batch_invariant_splits(kv_heads)
    one = attend(alone, splits)
    among = attend(everyone, splits)
    assert torch.equal(one[0], among[5])
    others = [i for i in range(batch) if i != 5][:4]  # and a few others, each alone
    for i in others:
        assert torch.equal(attend(torch.tensor([i], device=dev), splits)[0], among[i]), i
    # and it is the attention, to within bfloat16's rounding
    ref = reference_decode(q[5], k_cache, v_cache, page_table[5], int(lens[5]), k[5], v[5], rope, page_size, scale)
    torch.testing.assert_close(one[0].float(), ref, atol=2e-2, rtol=2e-2)
    plain_alone = attend(alone, num_splits_for(1, kv_heads))
    plain_among = attend(everyone, num_splits_for(batch, kv_heads))
    print(f"\nplain decoding's splits ({num_splits_for(1, kv_heads)} alone, {num_splits_for(batch, kv_heads)} "
          f"among {batch}): {int((plain_alone[0] != plain_among[5]).sum())} of {plain_alone[0].numel()} "
          "values differ")


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                     length: int, k_new: torch.Tensor, v_new: torch.Tensor, rope: nn.Module, page_size: int,
                     scale: float) -> torch.Tensor:
    """One sequence's decode attention in float32: its cached keys, then the new token (rotated)."""
    pos = torch.arange(length - 1, device=q.device)
    loc = pages[pos // page_size].long() * page_size + pos % page_size
    position = torch.tensor([length - 1], device=q.device)
    q_rot, k_rot = rope(position, q.unsqueeze(0).float(), k_new.unsqueeze(0).float())
    keys = torch.cat([k_cache[loc].float(), k_rot], 0)  # [L, Hkv, D]
    values = torch.cat([v_cache[loc].float(), v_new.unsqueeze(0).float()], 0)
    out = nn.functional.scaled_dot_product_attention(
        q_rot.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)[0]
