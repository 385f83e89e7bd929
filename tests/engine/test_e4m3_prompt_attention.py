"""A prompt's attention in e4m3 over an FP8 KV cache, on the CPU: what the scheme (query rows and softmax
probabilities rounded to e4m3, the pages read as they are) costs against exact attention, its causality, a chunk
after a cached prefix, where the engine turns it on, and the flag. The GPU kernel is held to this arithmetic in
test_e4m3_prompt_attention_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.layers.e4m3_prompt_attention import (
    e4m3_prompt_attention_reference,
    e4m3_prompt_attention_runs,
    quantize_query_rows,
)
from splitserve.engine.quantization.kv_fp8 import dequantize_kv, quantize_kv

FP8 = torch.float8_e4m3fn


def pages(n: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """bfloat16 queries, and e4m3 keys and values of about 50 stored (e4m3's normal range) with per-head scales."""
    gen = torch.Generator().manual_seed(seed)
    k_scale, v_scale = torch.linspace(0.002, 0.05, kv_heads), torch.linspace(0.3, 0.01, kv_heads)
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    keys = quantize_kv(torch.randn(n, kv_heads, head_dim, generator=gen) * 50 * k_scale.view(-1, 1), k_scale)
    values = quantize_kv(torch.randn(n, kv_heads, head_dim, generator=gen) * 50 * v_scale.view(-1, 1), v_scale)
    return q, keys, values, k_scale, v_scale


def exact(q, keys, values, k_scale, v_scale, sm_scale):
    """float64 causal attention of q [n, H, D] (a prompt's last n rows, unrounded) over the dequantized keys and
    values of all its kv_len tokens (the GPU tests' truth too)."""
    group = q.shape[1] // keys.shape[1]
    k = dequantize_kv(keys, k_scale, torch.float64).repeat_interleave(group, 1)
    v = dequantize_kv(values, v_scale, torch.float64).repeat_interleave(group, 1)
    n, kv_len = q.shape[0], keys.shape[0]
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * sm_scale
    visible = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)
    return torch.einsum("hmn,nhd->mhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (4, 2, 32)])
@pytest.mark.parametrize("n", [1, 9, 300])
def test_the_scheme_stays_within_a_few_percent_of_exact_attention_over_the_pages(heads, kv_heads, head_dim, n):
    q, keys, values, k_scale, v_scale = pages(n, heads, kv_heads, head_dim)
    got = e4m3_prompt_attention_reference(q, keys, values, k_scale, v_scale, head_dim ** -0.5, block_n=64)
    truth = exact(q, keys, values, k_scale, v_scale, head_dim ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    rel = ((got.double() - truth).norm() / truth.norm()).item()
    assert rel < 0.05, rel
    if n == 1:  # one key: its value exactly, up to the probability's e4m3 rounding (1 * 256 is exact)
        torch.testing.assert_close(got.double(), truth, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prefix", [64, 100, 150])
def test_a_chunk_after_its_prefix_attends_as_the_whole_prompts_last_rows(prefix) -> None:
    q, keys, values, k_scale, v_scale = pages(200, 4, 2, 32, seed=2)
    whole = e4m3_prompt_attention_reference(q, keys, values, k_scale, v_scale, 32 ** -0.5, block_n=64)
    chunk = e4m3_prompt_attention_reference(q[prefix:], keys, values, k_scale, v_scale, 32 ** -0.5, block_n=64)
    torch.testing.assert_close(chunk, whole[prefix:], rtol=1e-5, atol=1e-5)


def test_query_rows_get_their_own_scale_and_all_zero_rows_stay_zero() -> None:
    q = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 1.0, -3000.0]])
    q8, scale = quantize_query_rows(q)
    assert q8.dtype == FP8 and scale.shape == (3, 1)
    assert q8.float().abs().amax(-1).tolist() == [448.0, 0.0, 448.0]
    assert torch.equal(q8[1].float(), torch.zeros(3))
    torch.testing.assert_close(q8.float() * scale, q, rtol=1 / 16, atol=0)


def test_a_prompts_first_rows_do_not_see_what_follows() -> None:
    q, keys, values, k_scale, v_scale = pages(200, 4, 2, 32, seed=1)
    whole = e4m3_prompt_attention_reference(q, keys, values, k_scale, v_scale, 32 ** -0.5, block_n=64)
    values2 = values.clone()
    values2[150:] = quantize_kv(torch.full((50, 2, 32), 7.0), v_scale)
    changed = e4m3_prompt_attention_reference(q, keys, values2, k_scale, v_scale, 32 ** -0.5, block_n=64)
    assert torch.equal(whole[:150], changed[:150]) and not torch.equal(whole[150:], changed[150:])


def test_where_the_engine_attends_in_e4m3() -> None:
    cpu = torch.device("cpu")
    assert not e4m3_prompt_attention_runs("auto", FP8, torch.bfloat16, 128, cpu)  # a GPU kernel
    assert not e4m3_prompt_attention_runs("off", FP8, torch.bfloat16, 128, cpu)
    cuda = torch.device("cuda", 0)  # every refusal below is decided before the device is asked
    assert not e4m3_prompt_attention_runs("off", FP8, torch.bfloat16, 128, cuda)
    assert not e4m3_prompt_attention_runs("auto", torch.bfloat16, torch.bfloat16, 128, cuda)  # a 16-bit cache
    assert not e4m3_prompt_attention_runs("auto", FP8, torch.float32, 128, cuda)  # float32 runs check exactness
    assert not e4m3_prompt_attention_runs("auto", FP8, torch.bfloat16, 256, cuda)  # past the kernel's tiles
    assert not e4m3_prompt_attention_runs("auto", FP8, torch.bfloat16, 16, cuda)
    with pytest.raises(ValueError, match="--fp8-prompt-attention must be one of auto, off"):
        e4m3_prompt_attention_runs("on", FP8, torch.bfloat16, 128, cpu)


def test_the_flag_comes_from_the_command_line_or_the_environment(capsys: pytest.CaptureFixture) -> None:
    from splitserve.api.serve_config import parse_configs

    assert parse_configs([], environ={}).engine.fp8_prompt_attention == "auto"
    assert parse_configs(["--fp8-prompt-attention", "off"], environ={}).engine.fp8_prompt_attention == "off"
    assert parse_configs([], environ={"SPLITSERVE_FP8_PROMPT_ATTENTION": "off"}).engine.fp8_prompt_attention == "off"
    with pytest.raises(SystemExit):
        parse_configs(["--fp8-prompt-attention", "fp8"], environ={})
    assert "--fp8-prompt-attention" in capsys.readouterr().err


def test_a_cpu_runner_widens_the_pages_and_says_so_in_its_layer_scales(tmp_path: Path) -> None:
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path / "tiny", TINY_CONFIG, seed=0)
    cfg = EngineConfig(model=str(folder), device="cpu", page_size=4, max_total_tokens=512, context_length=256,
                       max_running_requests=2, kv_cache_dtype="fp8_e4m3")
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    scales = runner.kv_pool.layer_scales(0)
    assert scales is not None and scales.e4m3_prompts is False and runner.kv_pool.e4m3_prompts is False
