"""Piecewise CUDA graphs of extend steps (engine/runner/piecewise_graphs.py): the buckets, which steps take them,
that the
padded pieces give the unpadded forward's logits, and an engine's pages after a mixed load with them (CPU, where
the pieces run eagerly); on the GPU that a replay gives the eager padded pieces' bits and the unpadded forward's
logits and KV to bf16 rounding, writes nothing outside the step's rows and the scratch page, that an engine gives
the same greedy tokens with the graphs and with --disable-cuda-graph under a mixed load, and the graphs' pool.
The GPU tests run only where CUDA is (an H200, say): `pytest tests/engine/test_piecewise_graphs.py`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from splitserve.engine.runner.piecewise_graphs import BUCKETS, piecewise_buckets

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("max_tokens,buckets", [
    (2048, BUCKETS), (4096, (*BUCKETS, 4096)), (1024, BUCKETS[:BUCKETS.index(1024) + 1]), (1100, (*BUCKETS[:17], 1100)),
    (300, (16, 32, 48, 64, 96, 128, 160, 192, 256, 300)),
    (64, (16, 32, 48, 64)), (10, (10,)), (0, ())])
def test_the_buckets_are_the_fixed_ones_below_the_limit_then_the_limit(max_tokens: int, buckets: tuple) -> None:
    assert piecewise_buckets(max_tokens) == buckets


@pytest.mark.parametrize("max_tokens", [2048, 1024, 512, 300, 64, 17, 16, 10])
def test_padding_never_moves_a_step_across_the_row_invariant_limit(max_tokens: int) -> None:
    # 16-bit projections of up to skinny.MAX_ROWS rows take the row-invariant kernel and larger ones cuBLAS: a step
    # padded from one side of that limit to the other would change its rows' rounding, not just their count.
    from splitserve.engine.layers.skinny import MAX_ROWS

    buckets = piecewise_buckets(max_tokens)
    for n in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= n)
        assert (n <= MAX_ROWS) == (bucket <= MAX_ROWS), (n, bucket)


def test_the_fixed_buckets_pad_at_most_a_third_past_64_tokens_a_quarter_past_96_a_fifth_past_256() -> None:
    def worst(past: int) -> float:
        return max((b - n) / b for n in range(past + 1, BUCKETS[-1] + 1) for b in [next(b for b in BUCKETS if b >= n)])

    assert worst(64) <= 1 / 3 and worst(96) <= 1 / 4 and worst(256) <= 1 / 5
    assert worst(64) > 1 / 4  # 65 -> 96


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_writes_in_place_the_pieces_make_give_the_allocating_calls_bits(device: str, dtype: torch.dtype) -> None:
    # The pieces add into the residual buffer where it lies and write the qkv rows of theirs
    # (engine/runner/piecewise_graphs.py): the same bits as the calls that return new tensors, at a cuBLAS row count
    # (2,048) and a row-invariant one (16).
    from splitserve.engine.layers.linear import ColumnParallelLinear
    from splitserve.engine.layers.rmsnorm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(256, 1e-5, dtype).to(device)
    norm.weight.copy_(torch.rand(256, generator=gen, dtype=torch.float32).to(dtype))
    linear = ColumnParallelLinear(256, [384, 64, 64], bias=False, dtype=dtype).to(device)
    linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen).to(dtype) / 16)
    biased = ColumnParallelLinear(256, [96], bias=True, dtype=dtype).to(device)
    biased.weight.copy_(torch.randn(biased.weight.shape, generator=gen).to(dtype) / 16)
    biased.bias.copy_(torch.randn(96, generator=gen).to(dtype))
    for rows in (2048, 16):
        x = torch.randn(rows, 256, generator=gen).to(dtype).to(device)
        residual = torch.randn(rows, 256, generator=gen).to(dtype).to(device)
        normed, new_residual = norm(x, residual)
        buffer = residual.clone()
        normed_in_place, returned = norm(x, buffer, residual_out=buffer)
        assert returned.data_ptr() == buffer.data_ptr()
        assert torch.equal(normed_in_place, normed) and torch.equal(buffer, new_residual)
        for layer in (linear, biased):
            out = torch.full((rows, layer.weight.shape[0]), float("nan"), dtype=dtype, device=device)
            assert layer(normed, out=out) is out and torch.equal(out, layer(normed)), (rows, layer.bias is None)


def cpu_runner(tmp_path: Path, **cfg):
    """A float32 runner of a tiny GQA Llama on the CPU and its KV cache, warmed up (its pieces built)."""
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 2048}, 1234)
    config = EngineConfig(model=str(folder), device="cpu", page_size=16, max_total_tokens=2048,
                          max_running_requests=8, **cfg)
    runner = ModelRunner(config, folder, ModelConfig.from_folder(folder))
    kv = KVCache(runner.kv_shape.num_pages, config.page_size, 8, 2048, runner.device)
    runner.warm_up(kv.page_table)
    return runner, kv


def test_a_step_takes_the_smallest_bucket_that_holds_it(tmp_path: Path) -> None:
    runner, _ = cpu_runner(tmp_path, piecewise_graph_tokens=300)
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.buckets == piecewise_buckets(300) and not graphs.graphs  # never captured
    for tokens, bucket in [(1, 16), (16, 16), (17, 32), (193, 256), (257, 300), (300, 300), (301, None)]:
        assert graphs.bucket(tokens) == bucket and graphs.can_run(tokens) == (bucket is not None)


def mixed_step(runner, kv, gen: torch.Generator, decodes: int, prefix: int, chunk: int, fresh: int):
    """Chunks of a mixed step, the requests before it prefilled eagerly: `decodes` decode rows (each after a
    prompt of 20 + i tokens), a chunk of `chunk` tokens after a cached prefix of `prefix`, a fresh prompt of
    `fresh` (0: none of either). Returns the chunks and the requests (to release)."""
    from splitserve.engine.request import Request
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import ScheduledChunk

    def admitted(n: int) -> Request:
        req = Request(f"r{len(reqs)}", torch.randint(0, 256, (n,), generator=gen).tolist(),
                      SamplingParams(max_new_tokens=4, temperature=0.0), on_output=lambda _o: None)
        kv.admit(req, max_prefix_tokens=0)
        assert kv.grow(req, n)
        reqs.append(req)
        return req

    reqs: list = []
    chunks = []
    for i in range(decodes):  # a prompt, prefilled, then its first output token as a decode row
        req = admitted(20 + i)
        out = runner.run([ScheduledChunk(req, 0, 20 + i, True)], kv.page_table)
        req.output_ids.extend(out.tokens)
        assert kv.grow(req, 21 + i)
        chunks.append(ScheduledChunk(req, 20 + i, 1, True))
    if chunk:
        req = admitted(prefix + chunk)
        runner.run([ScheduledChunk(req, 0, prefix, False)], kv.page_table)
        chunks.append(ScheduledChunk(req, prefix, chunk, True))
    if fresh:
        chunks.append(ScheduledChunk(admitted(fresh), 0, fresh, True))
    return chunks, reqs


def step_batch(runner, kv, chunks):
    from splitserve.engine.runner.model_runner import build_forward_batch

    return build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device, runner.next_tokens,
                               runner.extend_block_tokens, runner.cudnn_chunk, runner.prompt_buckets)


@torch.inference_mode()
def test_only_text_extend_steps_up_to_the_largest_bucket_in_the_default_mode_take_the_pieces(tmp_path: Path) -> None:
    from splitserve.engine.runner.forward_batch import decode_batch
    from splitserve.engine.scheduler import ScheduledChunk

    runner, kv = cpu_runner(tmp_path, piecewise_graph_tokens=64)
    gen = torch.Generator().manual_seed(0)
    ran: list[int] = []
    real_run = runner.piecewise_graphs.run
    runner.piecewise_graphs.run = lambda batch: (ran.append(batch.input_ids.shape[0]), real_run(batch))[1]
    chunks, reqs = mixed_step(runner, kv, gen, decodes=2, prefix=32, chunk=8, fresh=13)
    assert ran == [20, 21, 32]  # the prompts before it: lone fresh prompts (the CPU has no lone-prompt graphs)
    ran.clear()
    runner.run(chunks, kv.page_table)
    assert ran == [23]  # the mixed step
    runner.run(chunks[:2], kv.page_table)  # two decode rows: a decode step
    assert ran == [23]
    assert kv.grow(reqs[1], 24)
    verify = ScheduledChunk(reqs[1], 21, 3, True, draft=[5, 6])
    out = runner.run([verify, chunks[3]], kv.page_table)  # a verify chunk beside a prompt chunk
    assert ran == [23, 16] and len(out.verified) == 1 and out.tokens and len(out.tokens) == 1
    batch = step_batch(runner, kv, chunks)
    assert runner._piecewise_runs(batch)
    assert not runner._piecewise_runs(decode_batch(batch.input_ids[:2], batch.positions[:2],
                                                   torch.tensor([reqs[0].slot, reqs[1].slot]), kv.page_table,
                                                   kv.page_size))
    batch.image_rows = torch.zeros(1, runner.model_cfg.hidden_size)  # a multimodal prompt's image rows
    assert not runner._piecewise_runs(batch)
    long_chunks, long_reqs = mixed_step(runner, kv, gen, decodes=0, prefix=0, chunk=0, fresh=65)
    assert not runner._piecewise_runs(step_batch(runner, kv, long_chunks))  # past the largest bucket
    runner.row_invariant_rows = 32  # a verifier's row-invariant projections: padding would change their path
    assert not runner._piecewise_runs(step_batch(runner, kv, chunks))
    runner.row_invariant_rows, runner.batch_invariant_attention = 16, True
    assert not runner._piecewise_runs(step_batch(runner, kv, chunks))
    for req in reqs + long_reqs:
        kv.release(req, cache_prefix=False)
    off, _ = cpu_runner(tmp_path / "off")
    assert off.piecewise_graphs is None  # the default on the CPU: none built, extend steps run the plain forward
    off, _ = cpu_runner(tmp_path / "zero", piecewise_graph_tokens=0)
    assert off.piecewise_graphs is None


def test_the_default_limit_is_512_tokens_on_a_gpu_and_none_on_the_cpu() -> None:
    from splitserve.engine.runner.piecewise_graphs import DEFAULT_GPU_TOKENS, piecewise_tokens

    assert DEFAULT_GPU_TOKENS == 512
    assert piecewise_tokens(-1, torch.device("cuda")) == 512 and piecewise_tokens(-1, torch.device("cpu")) == 0
    assert piecewise_tokens(0, torch.device("cuda")) == 0 and piecewise_tokens(300, torch.device("cpu")) == 300


@torch.inference_mode()
def test_the_padded_pieces_give_the_unpadded_forward_s_logits_of_a_mixed_step(tmp_path: Path) -> None:
    runner, kv = cpu_runner(tmp_path, piecewise_graph_tokens=1024)
    graphs = runner.piecewise_graphs
    gen = torch.Generator().manual_seed(1)
    for decodes, prefix, chunk, fresh in [(3, 32, 8, 13), (0, 0, 0, 200), (1, 48, 30, 0), (4, 0, 0, 2)]:
        chunks, reqs = mixed_step(runner, kv, gen, decodes, prefix, chunk, fresh)
        batch = step_batch(runner, kv, chunks)
        unpadded = runner.model(batch, runner.kv_pool)
        pools = [c for i in range(len(runner.model.layers))
                 for c in (runner.kv_pool.k_cache(i), runner.kv_pool.v_cache(i))]
        unpadded_kv = [p.clone() for p in pools]
        step_loc = batch.out_cache_loc
        for p in pools:  # every row of the step must be stored again before a row of it reads it
            p[step_loc] = float("nan")
        padded = graphs.run(batch)
        assert padded.dtype == torch.float32 and padded.shape == unpadded.shape == (len(chunks), 300)
        torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
        others = torch.ones(pools[0].shape[0], dtype=torch.bool)
        others[step_loc] = False
        for p, u in zip(pools, unpadded_kv, strict=True):
            assert torch.equal(p[others], u[others])  # the padding rows store no KV: no other row of any layer changes
            torch.testing.assert_close(p[step_loc], u[step_loc], rtol=1e-5, atol=1e-5)
        for req in reqs:
            kv.release(req, cache_prefix=False)


def mixed_load(**cfg):
    """Greedy tokens of an engine (the tiny model, float32 on the CPU) where prompts start while others decode (more
    prompts than running slots, each with its own output length), and the steps that ran through the pieces (their
    tokens and decode rows)."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=16, max_total_tokens=4096,
                                 max_running_requests=3, disable_prefix_cache=True, decode_first=True, **cfg))
    engine.start()
    try:
        ran: list[tuple[int, int]] = []
        graphs = engine.runner.piecewise_graphs
        if graphs is not None:
            real_run = graphs.run
            graphs.run = lambda b: (ran.append((b.input_ids.shape[0], int((b.extend_lens == 1).sum()))),
                                    real_run(b))[1]
        free = engine.kv.usage().free
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 7, 90, 33, 130, 12, 64, 25)]
        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in (9, 30, 14, 21, 5, 26, 17, 11)]
        out = generate_tokens(engine, prompts, params, timeout=120)
        assert engine.kv.usage().free == free
        return out, ran
    finally:
        engine.stop()


@pytest.mark.slow
def test_an_engine_under_a_mixed_load_through_the_pieces_gives_its_pages_back_and_the_eager_tokens() -> None:
    tokens, ran = mixed_load(piecewise_graph_tokens=128)
    assert any(decodes and n > decodes for n, decodes in ran), ran  # decode rows beside prompt chunks
    assert all(n <= 128 for n, _ in ran)
    eager, none = mixed_load()
    assert none == [] and tokens == eager


# ---- GPU ----------------------------------------------------------------------------------------------------

def bf16_runner(tmp_path: Path, **cfg):
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 2048}, 1234)
    config = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=16384,
                          max_running_requests=8, piecewise_graph_tokens=2048, **cfg)
    runner = ModelRunner(config, folder, ModelConfig.from_folder(folder))
    kv = KVCache(runner.kv_shape.num_pages, config.page_size, 8, 2048, runner.device)
    runner.warm_up(kv.page_table)
    return runner, kv


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_a_replay_gives_the_eager_padded_bits_the_unpadded_logits_and_kv_and_touches_no_other_row(
        tmp_path: Path) -> None:
    runner, kv = bf16_runner(tmp_path)
    graphs = runner.piecewise_graphs
    assert graphs is not None and graphs.buckets == BUCKETS
    assert set(graphs.graphs) == {(b, p) for b in BUCKETS for p in range(graphs.pieces)}
    gen = torch.Generator().manual_seed(0)
    pools = [runner.kv_pool.k_cache(0), runner.kv_pool.v_cache(0), runner.kv_pool.k_cache(2)]
    mixes = [(3, 64, 40, 100), (0, 0, 0, 7), (2, 0, 0, 9), (0, 200, 300, 0), (5, 0, 0, 1019), (1, 48, 16, 0),
             (6, 128, 64, 200), (4, 0, 0, 1700), (0, 512, 1536, 0)]
    for decodes, prefix, chunk, fresh in mixes:
        chunks, reqs = mixed_step(runner, kv, gen, decodes, prefix, chunk, fresh)
        batch = step_batch(runner, kv, chunks)
        step_loc = batch.out_cache_loc
        before = [p.clone() for p in pools]
        graphed = graphs.run(batch).clone()
        graphed_kv = [p.clone() for p in pools]
        captured, graphs.graphs = graphs.graphs, {}
        try:
            eager_padded = graphs.run(batch)  # the same pieces, eagerly
        finally:
            graphs.graphs = captured
        assert torch.equal(graphed, eager_padded), (decodes, prefix, chunk, fresh)
        for buffer in (graphs.residual, graphs.qkv, graphs.attn_out):  # a real row reads nothing stale
            buffer.fill_(float("nan"))
        assert torch.equal(graphs.run(batch), graphed), (decodes, prefix, chunk, fresh)
        assert all(torch.equal(p, g) for p, g in zip(pools, graphed_kv, strict=True))
        untouched = torch.ones(pools[0].shape[0], dtype=torch.bool, device=runner.device)
        untouched[step_loc] = False
        untouched[:kv.page_size] = False  # the scratch page
        for b, g in zip(before, graphed_kv, strict=True):
            assert torch.equal(g[untouched], b[untouched])
        unpadded = runner.model(batch, runner.kv_pool)  # the plain eager forward, unpadded
        assert relative(graphed, unpadded) < 2e-2, (decodes, prefix, chunk, fresh)
        for g, p in zip(graphed_kv, pools, strict=True):  # the KV of the step's rows, unpadded
            assert relative(g[step_loc], p[step_loc]) < 2e-2
        for req in reqs:
            kv.release(req, cache_prefix=False)


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_the_graphs_pool_holds_one_piece_s_temporaries_not_every_piece_s_outputs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Llama-3.2-1B's shape (random weights): 17 buckets x 16 pieces. Keeping every piece's outputs (its qkv and
    # residual rows) would take sum(buckets) x pieces x (qkv + hidden) x 2 B, ~1 GB; a piece's temporaries at 1,024
    # tokens (the MLP's gate/up rows the largest) ~75 MB. What the capture reserved also holds cuBLAS's workspace
    # for the capture's stream.
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_shape_folder("llama-3.2-1b", tmp_path / "shape")
    config = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", load_format="dummy", page_size=16,
                          max_total_tokens=16384, max_running_requests=8, context_length=2048,
                          prompt_graph_tokens=0, piecewise_graph_tokens=1024)
    runner = ModelRunner(config, folder, ModelConfig.from_folder(folder))
    kv = KVCache(runner.kv_shape.num_pages, config.page_size, 8, 2048, runner.device)
    with caplog.at_level(logging.INFO, logger="splitserve.engine.runner.piecewise_graphs"):
        runner.warm_up(kv.page_table)
    graphs = runner.piecewise_graphs
    buckets = piecewise_buckets(1024)
    assert graphs is not None and len(buckets) == 17 and len(graphs.graphs) == len(buckets) * 16
    cfg = runner.model_cfg
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    every_output = sum(buckets) * graphs.pieces * (qkv + cfg.hidden_size) * 2
    one_piece = 1024 * (3 * cfg.intermediate_size + 4 * cfg.hidden_size + qkv) * 2
    logging.getLogger(__name__).warning("piecewise pool %.1f MiB; every output kept %.1f MiB; a piece's "
                                        "temporaries ~%.1f MiB", graphs.pool_bytes / 2**20, every_output / 2**20,
                                        one_piece / 2**20)
    assert 0 < graphs.pool_bytes < every_output / 4
    assert any("piecewise CUDA graphs" in r.getMessage() and "pool" in r.getMessage() for r in caplog.records)
    runner.close()


@needs_cuda
@pytest.mark.gpu
def test_an_engine_gives_the_same_greedy_tokens_through_the_piecewise_graphs_and_eagerly_under_a_mixed_load(
        tmp_path: Path) -> None:
    # Requests arrive while others decode, so which rows share a step (and so a bucket) depends on timing and
    # differs between the two runs: float32, whose projections take the row-invariant kernels at every row
    # count, keeps a row's logits within float32 rounding of any other schedule's (bfloat16 rows through cuBLAS
    # round by the bucket; the replay test above checks their bits step by step). Float32 also has no lone-prompt
    # graphs (no cuDNN buckets): lone prompts take the pieces too.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096}, 1234)
    gen = torch.Generator().manual_seed(3)
    lengths = (300, 17, 1100, 64, 700, 5, 2000, 130, 1024, 40, 90, 512)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    # More prompts than running slots, each with its own output length: prompts start while others decode.
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (20, 45, 9, 33, 60, 14, 27, 50, 6, 38, 17, 41)]

    def run(tokens: int = 1024, **cfg) -> tuple[list[list[int]], list[tuple[int, int]], bool]:
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32", page_size=16,
                                     max_total_tokens=32768, max_running_requests=4, disable_prefix_cache=True,
                                     chunked_prefill_size=512, decode_first=True, piecewise_graph_tokens=tokens,
                                     **cfg))
        engine.start()
        try:
            ran: list[tuple[int, int]] = []
            graphs = engine.runner.piecewise_graphs
            assert (graphs is None) == (tokens == 0)
            if graphs is not None:
                assert graphs.buckets == piecewise_buckets(512)
                real_run = graphs.run
                graphs.run = lambda b: (ran.append((b.input_ids.shape[0], b.decode_rows)), real_run(b))[1]
            free = engine.kv.usage().free
            out = generate_tokens(engine, prompts, params, timeout=300)
            assert engine.kv.usage().free == free
            return out, ran, graphs is not None and bool(graphs.graphs)
        finally:
            engine.stop()

    graphed, ran, captured = run()
    eager, eager_ran, eager_captured = run(disable_cuda_graph=True)
    assert captured and not eager_captured
    # Decode rows beside prompt chunks (among them chunks after a cached prefix: the 700 to 2,000-token prompts
    # in 512-token chunks) went through the pieces, replayed and eagerly.
    for steps in (ran, eager_ran):
        assert any(decodes and n > decodes for n, decodes in steps), steps
    assert graphed == eager
    # And the plain forward's tokens (no pieces at all): the two runs above share the pieces' logic, which this
    # compares with the path it replaces (float32: the same bits row by row, the schedule aside).
    plain, _, _ = run(tokens=0)
    assert graphed == plain
