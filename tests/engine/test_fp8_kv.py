"""FP8 KV cache (--kv-cache-dtype fp8_e4m3) on the CPU: pages hold e4m3 with per-head scales, writes saturate,
every attention path reads the pages dequantized (the paths agree with each other, and not with float32 KV),
the pool holds twice a 16-bit cache's tokens in the same bytes, and the accuracy against float32 KV is stated."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_checkpoints import cpu_runner  # tests/ is on sys.path: conftest.py
from fp8_accuracy import smollm2_pair

from splitserve.bench.accuracy import accuracy
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.layers.attention import decode_attention_reference, store_kv
from splitserve.engine.quantization.kv_fp8 import (
    KV_SCALE_NAME,
    KVScaleError,
    checkpoint_kv_scales,
    dequantize_kv,
    kv_storage_dtype,
    quantize_kv,
    scales_digest,
)
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.tp.parallel_state import TensorParallel

FP8 = torch.float8_e4m3fn


def test_writes_saturate_and_read_back_within_e4m3_rounding_per_head() -> None:
    scales = torch.tensor([1.0, 0.25])
    x = torch.randn(64, 2, 16) * 3
    x[0, 0, 0], x[1, 1, 0] = 1e4, -1e4  # past +-448 * scale: saturated, never NaN
    q = quantize_kv(x, scales)
    assert q.dtype == FP8
    back = dequantize_kv(q, scales, torch.float32)
    assert back[0, 0, 0] == 448.0 and back[1, 1, 0] == -448.0 * 0.25
    assert not torch.isnan(back).any()
    ok = x.abs() < 400 * scales.view(1, -1, 1)
    # 3 mantissa bits: at most half a step (1/16 relative) in the normal range, and 2^-10 * scale absolute below it
    err = (back - x).abs()[ok]
    bound = torch.maximum(x.abs() / 16, 2.0 ** -10 * scales.view(1, -1, 1).expand_as(x))[ok]
    assert (err <= bound * 1.0001).all()
    assert err.max() > 0  # it did round


def test_the_storage_dtype_follows_the_flag_and_bad_values_are_refused() -> None:
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == FP8
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        kv_storage_dtype("fp8_e5m2", torch.bfloat16)
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", device="cpu").kv_dtype() == FP8
    pool = KVPool(KVPoolShape(2, 3, 4, 2, 8, torch.float32), torch.device("cpu"))
    assert pool.layer_scales(0) is None
    with pytest.raises(ValueError, match="not FP8"):
        pool.set_scales(torch.ones(2, 2, 2))
    fp8_pool = KVPool(KVPoolShape(2, 3, 4, 2, 8, FP8), torch.device("cpu"))
    with pytest.raises(ValueError, match="positive"):
        fp8_pool.set_scales(torch.zeros(2, 2, 2))


def test_decode_reference_reads_fp8_pages_with_per_head_scales() -> None:
    """The gather + SDPA decode over an e4m3 cache equals SDPA over the dequantized keys and values."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    pool = KVPool(KVPoolShape(1, 9, page, kv_heads, dim, FP8), torch.device("cpu"))
    pool.set_scales(torch.tensor([[[0.5, 2.0], [1.0, 0.125]]]))
    scales = pool.layer_scales(0)
    assert scales is not None
    k_cache, v_cache = pool.k_cache(0), pool.v_cache(0)
    lens = torch.tensor([7, 13])
    table = torch.tensor([[1, 2, 0, 0], [3, 5, 4, 6]], dtype=torch.int32)
    keys, values = torch.randn(2, 16, kv_heads, dim) * 4, torch.randn(2, 16, kv_heads, dim)
    for b in range(2):
        pos = torch.arange(int(lens[b]))
        loc = table[b, pos // page].long() * page + pos % page
        store_kv(k_cache, v_cache, loc, keys[b, :len(pos)], values[b, :len(pos)], scales)
    assert pool.buffer.dtype == FP8 and pool.buffer.view(torch.uint8).any()
    q = torch.randn(2, heads, dim)
    got = decode_attention_reference(q, k_cache, v_cache, table, torch.tensor([0, 1]), lens, page, dim ** -0.5,
                                     scales)
    for b in range(2):
        n = int(lens[b])
        k = dequantize_kv(quantize_kv(keys[b, :n], scales.k), scales.k, torch.float32).repeat_interleave(2, 1)
        v = dequantize_kv(quantize_kv(values[b, :n], scales.v), scales.v, torch.float32).repeat_interleave(2, 1)
        want = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * dim ** -0.5, -1)
        torch.testing.assert_close(got[b], torch.einsum("ht,thd->hd", want, v), atol=1e-5, rtol=1e-5)


def fp8_cpu_runner(folder: Path, kv_cache_dtype: str = "fp8_e4m3", **extra) -> tuple[ModelRunner, KVCache]:
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                       max_running_requests=4, kv_cache_dtype=kv_cache_dtype, **extra)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    return runner, KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 1024, runner.device)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_CONFIG, seed=0)


@torch.inference_mode()
def logits_by_steps(runner: ModelRunner, kv: KVCache, prompt: list[int], steps: list[int],
                    beside: list[int] | None = None, before_step: Callable[[int], None] | None = None
                    ) -> torch.Tensor:
    """Every position's logits of `prompt`, computed in steps of the given lengths (one step: a lone fresh
    prompt; several: chunks after a cached prefix; ones: decode steps). `beside`: a fresh prompt that rides
    in every step of more than one token (a padded batch of two). `before_step(i)`: called before step i."""
    req = Request("r", list(prompt), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    out = []
    try:
        start = 0
        for i, length in enumerate(steps):
            if before_step is not None:
                before_step(i)
            assert kv.grow(req, start + length)
            chunks = [ScheduledChunk(req, start, length, True)]
            other = None
            if beside and length > 1:
                other = Request(f"o{i}", list(beside), SamplingParams(), on_output=lambda _o: None)
                kv.admit(other, max_prefix_tokens=0)
                assert kv.grow(other, len(beside))
                chunks.append(ScheduledChunk(other, 0, len(beside), True))
            batch = build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device)
            batch.logits_index = torch.arange(length)
            out.append(runner.model(batch, runner.kv_pool))
            req.kv_len = start = start + length
            if other is not None:
                kv.release(other, cache_prefix=False)
    finally:
        kv.release(req, cache_prefix=False)
    return torch.cat(out)


def test_every_cpu_attention_path_reads_the_fp8_pages(tiny: Path) -> None:
    """A lone prompt, chunks after a cached prefix (alone and padded beside another prompt) and decode steps
    attend to the same dequantized KV: their logits agree to float32 rounding, while float32 KV differs by
    the e4m3 rounding. A path that attended to unquantized keys would differ by that much too."""
    prompt = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    runner, kv = fp8_cpu_runner(tiny)
    assert runner.kv_pool.buffer.dtype == FP8
    whole = logits_by_steps(runner, kv, prompt, [23])
    chunked = logits_by_steps(runner, kv, prompt, [9, 6, 8])
    padded = logits_by_steps(runner, kv, prompt, [9, 14], beside=list(range(5, 30)))
    decoded = logits_by_steps(runner, kv, prompt, [5] + [1] * 18)
    for other in (chunked, padded, decoded):
        torch.testing.assert_close(other, whole, atol=2e-5, rtol=2e-5)
    assert kv.usage().free == kv.usage().capacity
    reference, ref_kv = cpu_runner(tiny)
    exact = logits_by_steps(reference, ref_kv, prompt, [23])
    assert (exact - whole).abs().max() > 1e-3


def test_the_fp8_pool_holds_twice_the_tokens_of_bfloat16_in_the_same_bytes(tiny: Path) -> None:
    folder_cfg = ModelConfig.from_folder(tiny)
    pools = {}
    for dtype, kv_dtype in (("bfloat16", "auto"), ("bfloat16", "fp8_e4m3"), ("float32", "auto")):
        cfg = EngineConfig(model=str(tiny), device="cpu", dtype=dtype, page_size=16, mem_fraction=0.01,
                           max_running_requests=4, kv_cache_dtype=kv_dtype)
        shape = ModelRunner(cfg, tiny, folder_cfg).kv_shape
        pools[dtype, kv_dtype] = shape
    bf16, fp8, fp32 = pools["bfloat16", "auto"], pools["bfloat16", "fp8_e4m3"], pools["float32", "auto"]
    assert fp8.dtype == FP8 and fp8.page_bytes * 2 == bf16.page_bytes
    assert fp8.num_pages in (2 * bf16.num_pages, 2 * bf16.num_pages + 1)  # one budget, half the bytes a page
    assert fp8.num_pages in range(4 * fp32.num_pages, 4 * fp32.num_pages + 4)
    assert abs(fp8.total_bytes - bf16.total_bytes) <= fp8.bytes_per_page_all_layers(
        fp8.num_layers, fp8.page_size, fp8.num_kv_heads, fp8.head_dim, fp8.dtype)


# FP8 KV against float32 KV (float32 weights both), on the FP8 weights' prompts and measures. Measured when
# written: tiny KL 0.008, top-1 0.96, greedy 0.72. Tolerances a few times those: a wrong scale or a path that
# reads raw e4m3 bits fails by far, rounding noise passes.
MAX_MEAN_KL = 0.03
MIN_TOP1 = 0.85
MIN_GREEDY = 0.3


def test_fp8_kv_on_the_tiny_model_stays_close_to_float32_kv(tiny: Path, capsys) -> None:
    got = accuracy(cpu_runner(tiny), fp8_cpu_runner(tiny), TINY_CONFIG["vocab_size"])
    with capsys.disabled():
        print(f"\ntiny --kv-cache-dtype fp8_e4m3 vs float32 KV: {got}")
    assert got["mean_kl"] < MAX_MEAN_KL and got["top1"] >= MIN_TOP1 and got["greedy"] >= MIN_GREEDY, got


@pytest.mark.slow
def test_fp8_kv_on_smollm2(capsys) -> None:
    """SmolLM2-135M-Instruct (its GGUF file, float32 weights) with FP8 KV against float32 KV."""
    reference, fp8_kv, vocab = smollm2_pair(kv_cache_dtype="fp8_e4m3")
    got = accuracy(reference, fp8_kv, vocab)
    with capsys.disabled():
        print(f"\nSmolLM2-135M --kv-cache-dtype fp8_e4m3 vs float32 KV: {got}")
    assert got["mean_kl"] < 0.1 and got["top1"] >= 0.75 and not math.isnan(got["mean_kl"]), got


def test_scales_reach_the_attention_of_every_layer(tiny: Path) -> None:
    """Pages written with scale 2 hold half the values and give logits within e4m3 rounding of scale 1's; pages
    written with scale 2 and read with scale 1 do not: the paths read with the scales."""
    prompt, steps = list(range(3, 20)), [10] + [1] * 7
    one, kv_one = fp8_cpu_runner(tiny)
    two, kv_two = fp8_cpu_runner(tiny)
    two.kv_pool.set_scales(torch.full_like(two.kv_pool.scales, 2.0))
    a = logits_by_steps(one, kv_one, prompt, steps)
    b = logits_by_steps(two, kv_two, prompt, steps)
    # Layer 0's keys and values come from the embeddings alone: the same in both, stored halved.
    written, halved = one.kv_pool.buffer[0].float(), two.kv_pool.buffer[0].float()
    normal = written.abs() > 2 ** -5  # e4m3 is invariant to a power-of-two scale away from its subnormals
    assert normal.sum() > 1000
    torch.testing.assert_close(halved[normal], written[normal] / 2, atol=0, rtol=0)

    def read_with_one(i: int) -> None:
        if i == 1:  # the prompt was written with 2; the decode steps read its pages with 1
            two.kv_pool.set_scales(torch.ones_like(two.kv_pool.scales))

    two.kv_pool.set_scales(torch.full_like(two.kv_pool.scales, 2.0))
    c = logits_by_steps(two, kv_two, prompt, steps, before_step=read_with_one)
    noise = (a - b).abs().mean()
    assert noise < 0.01
    assert (a[10:] - c[10:]).abs().mean() > 10 * noise


def test_checkpoint_kv_scales_per_tensor_and_per_head_in_either_layout_shard_over_ranks() -> None:
    """ModelOpt's `k_proj.k_scale` and compressed-tensors' `self_attn.k_scale`; one value or one per KV head,
    each rank taking its heads' share; incomplete, misshapen or non-positive scales are refused by name."""
    found = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5),
             "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([2.0]),
             "model.layers.1.self_attn.k_scale": torch.tensor([1.0, 2.0, 3.0, 4.0]),
             "model.layers.1.self_attn.v_scale": torch.tensor(0.25, dtype=torch.bfloat16)}
    one = checkpoint_kv_scales(found, 2, 4, TensorParallel())
    assert one.tolist() == [[[0.5] * 4, [2.0] * 4], [[1.0, 2.0, 3.0, 4.0], [0.25] * 4]]
    second_rank = checkpoint_kv_scales(found, 2, 4, TensorParallel(rank=1, size=2))
    assert second_rank.tolist() == [[[0.5] * 2, [2.0] * 2], [[3.0, 4.0], [0.25] * 2]]
    assert checkpoint_kv_scales({}, 2, 4, TensorParallel()) is None
    with pytest.raises(KVScaleError, match=r"not for layer.k/v 1.v"):
        checkpoint_kv_scales({k: v for k, v in found.items() if not k.endswith("1.self_attn.v_scale")}, 2, 4,
                             TensorParallel())
    with pytest.raises(KVScaleError, match=r"3 values; a KV-cache scale is one value or one per KV head \(4\)"):
        checkpoint_kv_scales({**found, "model.layers.1.self_attn.k_scale": torch.ones(3)}, 2, 4, TensorParallel())
    with pytest.raises(KVScaleError, match="finite and positive"):
        checkpoint_kv_scales({**found, "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.0)}, 2, 4,
                             TensorParallel())
    with pytest.raises(KVScaleError, match="a second k scale for layer 0"):
        checkpoint_kv_scales({**found, "model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, 2, 4, TensorParallel())
    # A multimodal checkpoint's language model names them under language_model; a vision tower's are not KV scales.
    assert KV_SCALE_NAME.search("language_model.model.layers.3.self_attn.v_proj.v_scale")
    assert KV_SCALE_NAME.search("model.language_model.layers.3.self_attn.k_scale")
    assert not KV_SCALE_NAME.search("vision_tower.vision_model.encoder.layers.3.self_attn.k_proj.k_scale")
    with pytest.raises(KVScaleError, match="layer 2, but the model has 2"):
        checkpoint_kv_scales({**found, "model.layers.2.self_attn.k_scale": torch.tensor(1.0)}, 2, 4, TensorParallel())


def rescaled_checkpoint(src: Path, dst: Path, factor: float, scales: bool) -> Path:
    """`src` with keys and values `factor` times larger (k_proj, v_proj times it; q_proj, o_proj over it: the
    same model in exact arithmetic, for a power of two), and with `scales` the KV-cache scales that store them
    as `src`'s are stored with 1.0 (compressed-tensors' names)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    layers = 0
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * factor
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / factor
        if name.endswith("k_proj.weight"):
            layers += 1
    if scales:
        for i in range(layers):
            for which in "kv":
                tensors[f"model.layers.{i}.self_attn.{which}_scale"] = torch.tensor(factor)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_checkpoints_kv_scales_keep_keys_and_values_past_e4m3s_range(tiny: Path, tmp_path: Path) -> None:
    """Keys and values 1024 times larger than e4m3's range holds well: with the checkpoint's scales the pages hold
    what the original model's hold with 1.0 and the logits are the original's; without them they saturate."""
    prompt, steps = list(range(3, 30)), [12, 9] + [1] * 6
    original = logits_by_steps(*fp8_cpu_runner(tiny), prompt, steps)
    scaled_runner, scaled_kv = fp8_cpu_runner(rescaled_checkpoint(tiny, tmp_path / "scaled", 1024.0, scales=True))
    assert bool((scaled_runner.kv_pool.scales == 1024.0).all())
    scaled = logits_by_steps(scaled_runner, scaled_kv, prompt, steps)
    saturated = logits_by_steps(*fp8_cpu_runner(rescaled_checkpoint(tiny, tmp_path / "bare", 1024.0, scales=False)),
                                prompt, steps)
    torch.testing.assert_close(scaled, original, atol=1e-4, rtol=1e-4)
    assert (saturated - original).abs().mean() > 100 * (scaled - original).abs().mean() + 1e-3
    # A 16-bit KV cache leaves the scales unused (and says so): the same logits as the original in float32.
    plain = logits_by_steps(*fp8_cpu_runner(tmp_path / "scaled", kv_cache_dtype="auto"), prompt, steps)
    exact = logits_by_steps(*fp8_cpu_runner(tiny, kv_cache_dtype="auto"), prompt, steps)
    torch.testing.assert_close(plain, exact, atol=1e-4, rtol=1e-4)


def test_a_tensor_parallel_rank_resized_to_rank_0s_pool_keeps_the_checkpoints_scales(tiny: Path, tmp_path: Path):
    """And how its prompts attend (set here as a GPU runner with e4m3 tensor cores sets it)."""
    from splitserve.engine.tp.worker import resize_kv_pool

    runner, _ = fp8_cpu_runner(rescaled_checkpoint(tiny, tmp_path / "scaled", 1024.0, scales=True))
    runner.kv_pool.e4m3_prompts = True
    pages = runner.kv_shape.num_pages - 3
    resize_kv_pool(runner, pages)
    assert runner.kv_pool.buffer.shape[2] == pages
    assert bool((runner.kv_pool.scales == 1024.0).all())
    assert runner.kv_pool.e4m3_prompts and runner.kv_pool.layer_scales(0).e4m3_prompts


def test_the_scales_digest_names_calibrated_scales_alike_over_ranks_and_none_for_one(tiny: Path, tmp_path: Path):
    """What peers and the store compare: empty for 1.0 (any engine without checkpoint scales), the same digest for
    the same checkpoint, and another for other scales."""
    assert fp8_cpu_runner(tiny)[0].kv_scales_digest == ""
    assert scales_digest(torch.ones(4, 2, 2)) == "" and scales_digest(None) == ""
    scaled = fp8_cpu_runner(rescaled_checkpoint(tiny, tmp_path / "a", 1024.0, scales=True))[0].kv_scales_digest
    again = fp8_cpu_runner(tmp_path / "a")[0].kv_scales_digest
    other = fp8_cpu_runner(rescaled_checkpoint(tiny, tmp_path / "b", 512.0, scales=True))[0].kv_scales_digest
    assert scaled.startswith("kv-scales:") and scaled == again != other
    assert fp8_cpu_runner(tmp_path / "a", kv_cache_dtype="auto")[0].kv_scales_digest == ""  # 16-bit: unused
