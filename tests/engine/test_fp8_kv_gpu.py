"""FP8 KV cache on CUDA (skipped without CUDA): the Triton decode and extend kernels over e4m3 pages with per-head
scales against float64 attention over the dequantized pages, the fused RoPE store and the decode kernel's own
store writing torch's e4m3 bits, and the tiny model with --kv-cache-dtype fp8_e4m3 (graphs captured, warmed up)
against bfloat16 KV."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from splitserve.engine.quantization.kv_fp8 import KVScales, dequantize_kv, quantize_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).parent))  # test_gpu_path's references, whatever pytest's import mode
FP8 = torch.float8_e4m3fn
SHAPES = [(32, 8, 128, 16), (6, 2, 16, 4), (28, 4, 128, 16)]  # heads, kv_heads, head_dim, page_size


def fp8_caches(k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """e4m3 copies of random caches with a different scale per head (the values spread over e4m3's range)."""
    scales = KVScales(torch.linspace(0.05, 2.0, kv_heads, device="cuda"), torch.linspace(1.5, 0.1, kv_heads,
                                                                                          device="cuda"))
    return quantize_kv(k * 3, scales.k), quantize_kv(v, scales.v), scales


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", SHAPES)
def test_paged_decode_reads_fp8_pages_like_the_dequantized_reference(heads, kv_heads, head_dim, page_size, splits):
    from splitserve.engine.layers.attention import decode_attention_reference
    from splitserve.engine.layers.paged_decode_triton import paged_decode_attention

    torch.manual_seed(0)
    num_pages, max_pages, bsz = 400, 120, 5
    k = torch.randn(num_pages * page_size, kv_heads, head_dim, device="cuda")
    k_cache, v_cache, scales = fp8_caches(k, torch.randn_like(k), kv_heads)
    page_table = torch.randint(1, num_pages, (bsz + 1, max_pages), device="cuda", dtype=torch.int32)
    slots = torch.tensor([3, 0, 4, 1, 2], device="cuda")
    seq_lens = torch.tensor([1, 7, 100, max_pages * page_size // 2 + 3, max_pages * page_size], device="cuda")
    q = torch.randn(bsz, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, page_table, slots, seq_lens, page_size, scale, splits=splits,
                                 scales=scales)
    want = decode_attention_reference(q.float(), dequantize_kv(k_cache, scales.k, torch.float32),
                                      dequantize_kv(v_cache, scales.v, torch.float32), page_table, slots, seq_lens,
                                      page_size, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # and the torch reference over the e4m3 pages themselves reads them alike
    ref_fp8 = decode_attention_reference(q.float(), k_cache, v_cache, page_table, slots, seq_lens, page_size, scale,
                                         scales)
    torch.testing.assert_close(ref_fp8, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", SHAPES)
def test_paged_extend_and_decode_rows_read_fp8_pages_like_float64(heads, kv_heads, head_dim, page_size):
    from test_gpu_path import assert_rows_match_float64, paged_extend_batch, random_paged_step

    from splitserve.engine.layers.attention import PagedAttention
    from splitserve.engine.layers.extend_plan import wide_tiles

    torch.manual_seed(0)
    lengths, kv_lens, slots = [1, 1, 37, 130, 1, 300], [5, 900, 37, 530, 64, 300], [4, 0, 2, 5, 1, 3]
    page_table, k, v, q = random_paged_step(lengths, kv_lens, slots, heads, kv_heads, head_dim, page_size,
                                            torch.bfloat16)
    k_cache, v_cache, scales = fp8_caches(k.float(), v.float(), kv_heads)
    batch = paged_extend_batch(q, lengths, kv_lens, slots, page_table, page_size, heads // kv_heads,
                               wide_tiles(head_dim, 2), decode_rows=2)
    got = PagedAttention(heads, kv_heads, head_dim, 0)._paged_extend(q, batch, k_cache, v_cache, scales=scales)
    assert_rows_match_float64(got.float(), q, lengths, kv_lens, slots, dequantize_kv(k_cache, scales.k, torch.float64),
                              dequantize_kv(v_cache, scales.v, torch.float64), page_table, page_size, 2e-2)


def test_the_kernels_store_torchs_e4m3_bits() -> None:
    """The fused RoPE store (prompt rows) writes exactly quantize_kv of the bfloat16 key and value the 16-bit path
    stores; the decode kernel's store of its new token and store_rotated_kv (verify rows) write the same bits."""
    from splitserve.engine.layers.fused_triton import rope_and_store_kv
    from splitserve.engine.layers.paged_decode_triton import NewTokenKV, paged_decode_attention, store_rotated_kv
    from splitserve.engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, dim, rows, page, tokens = 8, 2, 64, 48, 16, 384
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None).to("cuda")
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16) * 4
    positions = torch.arange(rows, device="cuda") * 7
    loc = torch.randperm(rows, device="cuda") + page
    scales = KVScales(torch.tensor([0.5, 2.0], device="cuda"), torch.tensor([1.0, 0.25], device="cuda"))

    def caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.zeros(tokens, kv_heads, dim, device="cuda", dtype=dtype)
        return k, torch.zeros_like(k)

    k16, v16 = caches(torch.bfloat16)
    k8, v8 = caches(FP8)
    rope_and_store_kv(qkv.clone(), positions, rotary.cos, rotary.sin, heads, kv_heads, dim, k16, v16, loc)
    rope_and_store_kv(qkv.clone(), positions, rotary.cos, rotary.sin, heads, kv_heads, dim, k8, v8, loc, scales)
    assert k8.view(torch.uint8)[loc].any()
    assert torch.equal(k8.view(torch.uint8), quantize_kv(k16, scales.k).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize_kv(v16, scales.v).view(torch.uint8))

    # One decode row per request at each position (the kernel rotates at seq_len - 1): the kernel's own store,
    # then store_rotated_kv, give the same bits. Pages map to themselves: token t lives at t.
    q_len, kv_len = heads * dim, kv_heads * dim
    q, k, v = qkv.split([q_len, kv_len, kv_len], dim=1)
    new = NewTokenKV(k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim), rotary.cos, rotary.sin, loc)
    page_table = torch.arange(tokens // page, device="cuda", dtype=torch.int32).expand(rows + 1, -1).contiguous()
    fused_k, fused_v = caches(FP8)
    paged_decode_attention(q.reshape(rows, heads, dim), fused_k, fused_v, page_table, torch.arange(rows, device="cuda"),
                           positions + 1, page, dim ** -0.5, new, splits=1, scales=scales)
    rows_k, rows_v = caches(FP8)
    store_rotated_kv(new, positions, rows_k, rows_v, scales)
    assert torch.equal(fused_k.view(torch.uint8)[loc], rows_k.view(torch.uint8)[loc])
    assert torch.equal(fused_v.view(torch.uint8)[loc], rows_v.view(torch.uint8)[loc])


def test_fp8_kv_model_on_cuda_stays_close_to_bfloat16_kv(tmp_path: Path) -> None:
    """The tiny model in bfloat16 on CUDA (decode graphs captured, warmed up) with FP8 KV against bfloat16 KV: the
    CPU test's tolerances, and twice the pages in the same budget."""
    from test_fp8_kv import MAX_MEAN_KL, MIN_TOP1

    from splitserve.bench.accuracy import accuracy
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path / "tiny", TINY_CONFIG, seed=0)
    sides = []
    for kv_dtype in ("auto", "fp8_e4m3"):
        cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4, max_total_tokens=4096,
                           context_length=1024, chunked_prefill_size=512, max_running_requests=4,
                           kv_cache_dtype=kv_dtype)
        runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
        kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 1024, runner.device)
        runner.capture_decode_graphs(kv.page_table, kv.padding_slot)
        runner.warm_up(kv.page_table)
        sides.append((runner, kv))
    assert sides[1][0].kv_pool.buffer.dtype == FP8
    assert sides[1][0].kv_shape.page_bytes * 2 == sides[0][0].kv_shape.page_bytes
    got = accuracy(sides[0], sides[1], TINY_CONFIG["vocab_size"])
    print(f"tiny bf16 --kv-cache-dtype fp8_e4m3 vs bf16 KV on CUDA: {got}")
    assert got["mean_kl"] < 1.5 * MAX_MEAN_KL and got["top1"] >= MIN_TOP1, got
