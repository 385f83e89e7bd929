"""Lone-prompt CUDA graphs (engine/runner/prompt_graphs.py): which steps take one, which bucket a prompt takes, the
batch a
graph runs, and on the GPU that a graph's logits and KV are the eager padded batch's bits and the unpadded prompt's
to bf16 rounding, that it writes nothing but the prompt's pages and the scratch page, and that an engine gives the
same greedy tokens with and without graphs. The GPU tests run only where CUDA is (an H200, say)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.runner.prompt_graphs import PromptGraphs, prompt_batch, prompt_constants

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cpu_graphs(max_tokens: int, prompt_buckets: int) -> PromptGraphs:
    """PromptGraphs over a CPU page table, never captured (their capture is GPU only)."""
    return PromptGraphs(lambda _b: torch.empty(0), torch.zeros(5, 256, dtype=torch.int32), 16, 4, max_tokens,
                        prompt_buckets, torch.device("cpu"))


@pytest.mark.parametrize("max_tokens,prompt_buckets,lengths", [
    (1024, 2048, [256, 512, 768, 1024]), (1000, 2048, [256, 512, 768]), (1024, 512, [256, 512]),
    (255, 2048, []), (0, 2048, []), (1024, 0, [])])
def test_graph_lengths_are_the_multiples_of_256_up_to_the_limit_and_the_built_buckets(
        max_tokens: int, prompt_buckets: int, lengths: list[int]) -> None:
    assert cpu_graphs(max_tokens, prompt_buckets).lengths == lengths


@pytest.mark.parametrize("tokens,bucket", [(1, 256), (255, 256), (256, 256), (257, 512), (1024, 1024), (1025, None)])
def test_a_prompt_takes_the_smallest_bucket_that_holds_it(tokens: int, bucket: int | None) -> None:
    graphs = cpu_graphs(1024, 2048)
    assert graphs.bucket(tokens) == bucket and graphs.can_run(tokens) == (bucket is not None)
    assert cpu_graphs(1000, 2048).bucket(tokens) == (bucket if tokens <= 768 else None)


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


def test_only_a_step_of_one_fresh_prompt_chunk_with_every_id_on_the_host_takes_a_graph(tmp_path: Path) -> None:
    # The route's choice (ModelRunner._lone_prompt_graph_runs) on the CPU, with graphs of 256..1024 tokens set by
    # hand (their capture is GPU only): every kind of step that must keep the eager path.
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.multimodal.image_items import ImageItem
    from splitserve.engine.request import Request
    from splitserve.engine.runner.model_runner import ModelRunner
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import ScheduledChunk

    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096}, 1234)
    cfg = EngineConfig(model=str(folder), device="cpu", max_total_tokens=64, page_size=16, max_running_requests=4)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    runner.capture_prompt_graphs(torch.zeros(5, 256, dtype=torch.int32))
    assert runner.prompt_graphs is None  # never on the CPU

    def request(n: int, outputs: list[int] | None = None, images: list[ImageItem] | None = None) -> Request:
        req = Request(f"r{n}", list(range(n)), SamplingParams(max_new_tokens=4, temperature=0.0),
                      on_output=lambda _o: None, images=images or [])
        req.output_ids, req.slot = list(outputs or []), 0
        return req

    def takes(*chunks: ScheduledChunk) -> bool:
        return runner._lone_prompt_graph_runs(list(chunks))

    lone = ScheduledChunk(request(300), 0, 300, True)
    assert not takes(lone)  # no graphs: the eager path
    runner.prompt_graphs = cpu_graphs(1024, 2048)
    assert takes(lone) and takes(ScheduledChunk(request(1024), 0, 1024, True))
    assert not takes(ScheduledChunk(request(1025), 0, 1025, True))  # past the largest graph
    long = request(3000)
    assert takes(ScheduledChunk(long, 0, 512, False))  # a long prompt's first chunk: its KV, nothing sampled
    assert not takes(ScheduledChunk(long, 512, 512, False))  # a later chunk attends to the cached chunks
    assert not takes(lone, ScheduledChunk(request(200), 0, 200, True))  # prompts packed in one step
    assert not takes(ScheduledChunk(request(300), 299, 3, True, draft=[5, 6]))  # a verify chunk
    # A request computed again (preempted): prompt and outputs, every id known on the host; a last token
    # still being sampled on the device (the overlap's relay) is read by the eager path only.
    assert takes(ScheduledChunk(request(300, outputs=[7, 8]), 0, 302, True))
    assert not takes(ScheduledChunk(request(300, outputs=[7, 8]), 0, 303, True))
    assert not takes(ScheduledChunk(request(300, images=[ImageItem("d", 10, 20)]), 0, 300, True))
    assert takes(ScheduledChunk(request(300, images=[ImageItem("d", 400, 20)]), 0, 300, True))  # past the chunk
    runner.step_broadcaster = object()  # type: ignore[assignment]  # tensor-parallel rank 0 broadcasts batches
    assert not takes(lone)


def bf16_runner(tmp_path: Path, **cfg):
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

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
    from splitserve.engine.request import Request
    from splitserve.engine.runner.model_runner import build_forward_batch, kv_locations
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

    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

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
