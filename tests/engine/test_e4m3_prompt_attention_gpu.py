"""A prompt's attention over an FP8 KV cache in e4m3 on CUDA (skipped without a GPU with e4m3 tensor cores):
the kernel against its arithmetic in torch and against exact attention over the dequantized pages, fresh and
after a cached prefix, a prompt's first rows alike whatever follows them, graph replays, a long prompt's
chunks through it, and the tiny model with it on and off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from splitserve.engine.layers.e4m3_prompt_attention import e4m3_prompt_attention_reference, e4m3_prompt_attention_runs
from splitserve.engine.quantization.kv_fp8 import KVScales, quantize_kv

sys.path.insert(0, str(Path(__file__).parent))  # the CPU test's float64 truth, whatever pytest's import mode
from test_e4m3_prompt_attention import exact

FP8 = torch.float8_e4m3fn


def _e4m3_gpu() -> bool:
    return torch.cuda.is_available() and e4m3_prompt_attention_runs("auto", FP8, torch.bfloat16, 128,
                                                                     torch.device("cuda"))


pytestmark = pytest.mark.skipif(not _e4m3_gpu(), reason="needs a CUDA device with e4m3 tensor cores")
SHAPES = [(32, 8, 128), (28, 4, 128), (8, 8, 64), (4, 2, 32)]  # heads, kv_heads, head_dim
LENGTHS = [1, 7, 128, 129, 300, 1031]


def prompt(n: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q as a strided view of a projection [n, (H + 2 Hkv) D] in bfloat16, e4m3 pages at scattered locations of
    a 4n-token cache with per-head scales, and those locations."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    scales = KVScales(torch.linspace(0.002, 0.05, kv_heads, device="cuda"),
                      torch.linspace(0.3, 0.01, kv_heads, device="cuda"), True)
    # Stored values of about 50 (e4m3's normal range, unsaturated), the keys' scores 0.1-2.5 apart per head.
    k_cache = quantize_kv(torch.randn(4 * n, kv_heads, head_dim, device="cuda", generator=gen) * 50
                          * scales.k.view(-1, 1), scales.k)
    v_cache = quantize_kv(torch.randn(4 * n, kv_heads, head_dim, device="cuda", generator=gen) * 50
                          * scales.v.view(-1, 1), scales.v)
    loc = torch.randperm(4 * n, device="cuda", generator=gen)[:n]
    return q, k_cache, v_cache, loc, scales


def assert_computes_the_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel's output is the reference's but where a probability's rounding to e4m3 went the other way: the
    e4m3 tensor cores do not add the scores' products to float32's last bit, and exp2 is approximate, so a
    probability within that error of a rounding boundary takes the neighbouring code, moving its row by up to an
    e4m3 step of one term (measured: 0.01-0.3% of cells past the tight tolerance). The rest agree to the order of
    the sums and the bfloat16 output."""
    off = (out.float() - ref).abs() > 4e-3 * ref.abs().max() + 1e-2 * ref.abs()
    assert off.float().mean().item() < 0.01, f"{int(off.sum())} of {off.numel()} cells off"
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.01, rel


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_kernel_computes_its_torch_arithmetic(heads, kv_heads, head_dim, n) -> None:
    from splitserve.engine.layers.e4m3_prompt_attention_triton import LAUNCH, e4m3_prompt_attention

    q, k_cache, v_cache, loc, scales = prompt(n, heads, kv_heads, head_dim)
    sm_scale = head_dim ** -0.5
    out = e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, sm_scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = e4m3_prompt_attention_reference(q, k_cache[loc], v_cache[loc], scales.k, scales.v, sm_scale,
                                          block_n=LAUNCH[1])
    assert_computes_the_reference(out, ref)
    truth = exact(q, k_cache[loc], v_cache[loc], scales.k, scales.v, sm_scale)
    rel = ((out.double() - truth).norm() / truth.norm()).item()
    assert rel < 0.05, f"relative error {rel:.4f} against exact attention over the pages"


@pytest.mark.parametrize("chunk,prefix", [(128, 256), (100, 1000), (300, 37), (1, 500), (256, 129)])
def test_a_chunk_after_a_cached_prefix_computes_its_torch_arithmetic(chunk, prefix) -> None:
    from splitserve.engine.layers.e4m3_prompt_attention_triton import LAUNCH, e4m3_prompt_attention

    q, k_cache, v_cache, loc, scales = prompt(prefix + chunk, 32, 8, 128, seed=4)
    q = q[prefix:]  # the chunk's rows; the keys and values are the prefix's and its own
    out = e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5)
    ref = e4m3_prompt_attention_reference(q, k_cache[loc], v_cache[loc], scales.k, scales.v, 128 ** -0.5,
                                          block_n=LAUNCH[1])
    assert_computes_the_reference(out, ref)
    truth = exact(q, k_cache[loc], v_cache[loc], scales.k, scales.v, 128 ** -0.5)
    assert ((out.double() - truth).norm() / truth.norm()).item() < 0.05


@pytest.mark.parametrize("launch", [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 4)])
def test_every_swept_launch_computes_the_same_scheme(launch) -> None:
    from splitserve.engine.layers.e4m3_prompt_attention_triton import e4m3_prompt_attention

    q, k_cache, v_cache, loc, scales = prompt(517, 32, 8, 128, seed=3)
    out = e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5, launch=launch)
    ref = e4m3_prompt_attention_reference(q, k_cache[loc], v_cache[loc], scales.k, scales.v, 128 ** -0.5,
                                          block_n=launch[1])
    assert_computes_the_reference(out, ref)


def test_a_prompts_first_rows_attend_alike_whatever_follows() -> None:
    """Causal, block for block: a prompt's first m rows are the bits of the m-token prompt's."""
    from splitserve.engine.layers.e4m3_prompt_attention_triton import e4m3_prompt_attention

    q, k_cache, v_cache, loc, scales = prompt(700, 32, 8, 128, seed=1)
    whole = e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5)
    for m in (1, 130, 256, 699):
        head = e4m3_prompt_attention(q[:m], k_cache, v_cache, loc[:m], scales, 128 ** -0.5)
        assert torch.equal(head, whole[:m]), m


def test_graph_replays_give_eager_bits_and_write_out_in_place() -> None:
    from splitserve.engine.layers.e4m3_prompt_attention_triton import e4m3_prompt_attention

    q, k_cache, v_cache, loc, scales = prompt(384, 32, 8, 128, seed=2)
    out = torch.empty_like(q)
    e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5, out=out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5, out=out)
    for seed in (5, 6):
        q.copy_(prompt(384, 32, 8, 128, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, e4m3_prompt_attention(q, k_cache, v_cache, loc, scales, 128 ** -0.5))


def test_tiny_model_attends_in_e4m3_close_to_the_widened_pages(tmp_path: Path) -> None:
    """The tiny model in bfloat16 with FP8 KV (graphs captured, warmed up), lone prompts attending in e4m3
    against the same pages widened for cuDNN: the FP8 KV tests' tolerances."""
    from test_fp8_kv import MAX_MEAN_KL, MIN_TOP1

    from splitserve.bench.accuracy import accuracy
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path / "tiny", TINY_CONFIG, seed=0)
    sides = []
    for mode in ("off", "auto"):
        cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4, max_total_tokens=4096,
                           context_length=1024, chunked_prefill_size=512, max_running_requests=4,
                           kv_cache_dtype="fp8_e4m3", fp8_prompt_attention=mode)
        runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
        assert runner.kv_pool.e4m3_prompts == (mode == "auto")
        kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 1024, runner.device)
        runner.capture_decode_graphs(kv.page_table, kv.padding_slot)
        runner.warm_up(kv.page_table)
        sides.append((runner, kv))
    got = accuracy(sides[0], sides[1], TINY_CONFIG["vocab_size"])
    print(f"tiny bf16, FP8 KV: prompts in e4m3 vs widened: {got}")
    assert got["mean_kl"] < MAX_MEAN_KL and got["top1"] >= MIN_TOP1, got


@torch.inference_mode()
def test_a_long_prompts_chunks_attend_in_e4m3_close_to_the_widened_pages_and_to_one_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """3,072 tokens with FP8 KV in chunks of 1,024 (the second and third after 1,024 and 2,048 cached tokens: where
    a 16-bit cache takes cuDNN), the chunks in e4m3, then the same pages widened for cuDNN, and as one fresh
    prompt in e4m3: the logits agree to the FP8 attention's rounding."""
    from engine_checkpoints import LLAMA_GQA_LLAMA3_ROPE

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.layers import e4m3_prompt_attention_triton
    from splitserve.engine.layers.extend_plan import cudnn_prefixes
    from splitserve.engine.layers.prefix_chunk_attention import build_cudnn_graphs
    from splitserve.engine.request import Request
    from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import ScheduledChunk

    # head_dim 32: the least the e4m3 kernel takes (an e4m3 product multiplies 32 at a time).
    folder = write_checkpoint(tmp_path, {**LLAMA_GQA_LLAMA3_ROPE, "max_position_embeddings": 4096, "head_dim": 32},
                              1234)
    cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16, max_total_tokens=8192,
                       max_running_requests=4, kv_cache_dtype="fp8_e4m3")
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    assert runner.kv_pool.e4m3_prompts
    build_cudnn_graphs(1024, cudnn_prefixes(1024, 4096), 6, 2, 32, torch.bfloat16, runner.device)
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 4096, runner.device)
    prompt_ids = torch.randint(0, 256, (3072,), generator=torch.Generator().manual_seed(0)).tolist()
    req = Request("r", prompt_ids, SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    assert kv.grow(req, len(prompt_ids))
    real = e4m3_prompt_attention_triton.e4m3_prompt_attention
    prefixes: list[int] = []

    def counted(q, k_cache, v_cache, loc, *args, **kwargs):
        prefixes.append(loc.shape[0] - q.shape[0])
        return real(q, k_cache, v_cache, loc, *args, **kwargs)

    monkeypatch.setattr(e4m3_prompt_attention_triton, "e4m3_prompt_attention", counted)

    def logits(chunk: int) -> torch.Tensor:
        out = []
        for start in range(0, len(prompt_ids), chunk):
            batch = build_forward_batch([ScheduledChunk(req, start, chunk, True)], kv.page_table, kv.page_size,
                                        runner.device, tokens_per_block=runner.extend_block_tokens,
                                        cudnn_chunk=1024)
            batch.logits_index = torch.arange(chunk, device=runner.device)
            out.append(runner.model(batch, runner.kv_pool).float())
        return torch.cat(out)

    chunked = logits(1024)
    layers = runner.model_cfg.num_layers
    assert prefixes == [0] * layers + [1024] * layers + [2048] * layers  # the first chunk is a lone prompt
    runner.kv_pool.e4m3_prompts = False
    widened = logits(1024)
    runner.kv_pool.e4m3_prompts = True
    whole = logits(3072)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    print(f"e4m3 chunks vs widened: {rel(chunked, widened):.4f}, vs one chunk: {rel(chunked, whole):.4f}")
    assert torch.isfinite(chunked).all()
    assert rel(chunked, widened) < 0.1 and rel(chunked, whole) < 0.1
