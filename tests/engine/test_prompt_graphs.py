"""Lone-prompt CUDA graphs (engine/prompt_graphs.py): which bucket a prompt takes, the batch a graph runs, and on
the GPU that a graph's logits and KV are the eager padded batch's bits and the unpadded prompt's to bf16
rounding, that it writes nothing but the prompt's pages and the scratch page, and that an engine gives the same
greedy tokens with and without graphs. The GPU tests run only where CUDA is (the lent H200s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.prompt_graphs import graph_length, graph_lengths, prompt_batch, prompt_constants

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_graph_lengths_are_the_multiples_of_256_up_to_the_limit() -> None:
    assert graph_lengths(1024) == [256, 512, 768, 1024]
    assert graph_lengths(1000) == [256, 512, 768]
    assert graph_lengths(255) == []
    assert graph_lengths(0) == []


@pytest.mark.parametrize("tokens,bucket", [(1, 256), (255, 256), (256, 256), (257, 512), (1024, 1024), (1025, None)])
def test_a_prompt_takes_the_smallest_bucket_that_holds_it(tokens: int, bucket: int | None) -> None:
    assert graph_length(tokens, graph_lengths(1024)) == bucket


def test_the_graph_batch_puts_real_rows_in_the_prompt_s_pages_and_padding_rows_in_the_scratch_page() -> None:
    page_size, bucket, slot, padding_slot = 4, 8, 2, 3
    page_table = torch.zeros(4, 3, dtype=torch.int32)
    page_table[slot, :2] = torch.tensor([5, 7])  # slot 2 owns pages 5 and 7; the padding slot's row is page 0
    ids = [11, 12, 13, 14, 15, 16]
    inputs = torch.tensor([*ids, 0, 0, *range(6), 0, 0, *[slot] * 6, padding_slot, padding_slot, 5])
    batch = prompt_batch(inputs, bucket, page_table, page_size, 2048, prompt_constants(bucket, torch.device("cpu")))
    assert batch.input_ids.tolist() == [*ids, 0, 0]
    assert batch.out_cache_loc.tolist() == [20, 21, 22, 23, 28, 29, 0, 0]
    assert batch.logits_index.tolist() == [5]
    assert batch.no_prefix and batch.batch_size == 1 and batch.prompt_buckets == 2048
    assert batch.seq_lens.tolist() == [8] and batch.token_query_index.tolist() == list(range(8))
    # The views share the input tensor: a replay's new inputs are what the captured batch reads.
    inputs[0] = 99
    assert batch.input_ids[0] == 99


def bf16_runner(tmp_path: Path, **cfg):
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.tiny_model import write_checkpoint

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 2048}, 1234)
    config = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192,
                          max_running_requests=4, **cfg)
    runner = ModelRunner(config, folder, ModelConfig.from_folder(folder))
    kv = KVCache(runner.kv_shape.num_pages, config.page_size, 4, 2048, runner.device)
    runner.warm_up(kv.page_table)
    return runner, kv


@needs_cuda
@pytest.mark.gpu
@torch.inference_mode()
def test_a_graph_gives_the_eager_padded_bits_the_unpadded_logits_and_kv_and_touches_no_other_page(
        tmp_path: Path) -> None:
    from splitserve.engine.model_runner import build_forward_batch, kv_locations
    from splitserve.engine.request import Request
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import ScheduledChunk

    runner, kv = bf16_runner(tmp_path)
    graphs = runner.prompt_graphs
    assert graphs is not None and graphs.lengths == [256, 512, 768, 1024] and set(graphs.graphs) == set(graphs.lengths)
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = runner.kv_pool.k_cache(0), runner.kv_pool.v_cache(0)
    for length in (1, 37, 256, 300, 1000):
        ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        req = Request(f"r{length}", ids, SamplingParams(max_new_tokens=1, temperature=0.0), on_output=lambda _o: None)
        kv.admit(req, max_prefix_tokens=0)
        assert kv.grow(req, length)
        locations = kv_locations(kv.page_table.long(), req.slot, length, kv.page_size)
        before_k, before_v = k_pool.clone(), v_pool.clone()
        graphed = graphs.run(ids, req.slot).float().clone()
        graphed_k = k_pool.clone()
        captured, graphs.graphs = graphs.graphs, {}
        try:
            eager_padded = graphs.run(ids, req.slot).float()  # the same batch, no graph
        finally:
            graphs.graphs = captured
        assert torch.equal(graphed, eager_padded)
        # Nothing outside the prompt's positions and the scratch page (page 0) changed.
        untouched = torch.ones(k_pool.shape[0], dtype=torch.bool, device=k_pool.device)
        untouched[locations] = False
        untouched[:kv.page_size] = False
        assert torch.equal(graphed_k[untouched], before_k[untouched])
        assert torch.equal(v_pool[untouched], before_v[untouched])
        # The unpadded prompt, eagerly: the same logits and KV to bf16 rounding.
        batch = build_forward_batch([ScheduledChunk(req, 0, length, True)], kv.page_table, kv.page_size,
                                    runner.device, tokens_per_block=runner.extend_block_tokens,
                                    prompt_buckets=runner.prompt_buckets)
        unpadded = runner.model.logits(batch, runner.kv_pool).float()
        assert unpadded.shape == graphed.shape == (1, runner.model_cfg.vocab_size)
        assert float((graphed - unpadded).norm() / unpadded.norm()) < 2e-2
        real_k = graphed_k[locations].float()
        assert float((real_k - k_pool[locations].float()).norm() / real_k.norm()) < 2e-2
        kv.release(req, cache_prefix=False)


@needs_cuda
@pytest.mark.gpu
def test_an_engine_gives_the_same_greedy_tokens_with_lone_prompt_graphs_eagerly_and_past_them(
        tmp_path: Path) -> None:
    # One request at a time, so that every prompt is a lone one: through a graph (2..1024 tokens), through the
    # same padded batches eagerly (--disable-cuda-graph), and past the graphs (1100) on the eager path both times.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.tiny_model import write_checkpoint

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 2048}, 1234)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 33, 256, 300, 1024, 1100)]

    def run(**cfg) -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16,
                                     max_total_tokens=8192, max_running_requests=4, disable_prefix_cache=True, **cfg))
        engine.start()
        try:
            ran = []
            graphs = engine.runner.prompt_graphs
            assert graphs is not None and graphs.lengths == [256, 512, 768, 1024]
            assert bool(graphs.graphs) != bool(cfg.get("disable_cuda_graph"))
            real_run = graphs.run
            graphs.run = lambda ids, slot: (ran.append(len(ids)), real_run(ids, slot))[1]
            free = engine.kv.usage().free
            params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
            out = [generate_tokens(engine, [p], params, timeout=120)[0] for p in prompts]
            # A one-token prompt is a decode row (the decode graphs); 1100 tokens: past the prompt graphs.
            assert ran == [33, 256, 300, 1024]
            assert engine.kv.usage().free == free
            return out
        finally:
            engine.stop()

    assert run() == run(disable_cuda_graph=True)
