"""The decode-step roofline that counts compute (bench/step_roofline.py), beside the HBM one."""

from __future__ import annotations

import pytest

from splitserve.bench.step_roofline import decode_step_rooflines
from splitserve.engine.checkpoints.model_shapes import LLAMA_3_1_8B, matmul_params, prompt_matmul_flops

BANDWIDTH, PEAK = 4.2e12, 750e12  # about an H200's measured copy bandwidth and bf16 matmul rate
WEIGHTS = 2 * (matmul_params(LLAMA_3_1_8B) + 2 * LLAMA_3_1_8B["vocab_size"] * LLAMA_3_1_8B["hidden_size"])


def test_the_hbm_figure_is_weights_and_kv_at_the_bandwidth() -> None:
    kv_per_token = 2 * 8 * 128 * 2 * 32  # K and V, 8 KV heads of 128, bf16, 32 layers
    r = decode_step_rooflines(LLAMA_3_1_8B, 256, 1056, WEIGHTS, BANDWIDTH, PEAK)
    assert r["hbm_s"] == pytest.approx((WEIGHTS + 256 * 1056 * kv_per_token) / BANDWIDTH)


def test_one_row_is_memory_bound_everywhere_so_both_rooflines_agree() -> None:
    r = decode_step_rooflines(LLAMA_3_1_8B, 1, 1056, WEIGHTS, BANDWIDTH, PEAK)
    assert {op["bound"] for op in r["ops"].values()} == {"memory"}
    assert r["compute_s"] == pytest.approx(r["hbm_s"])


def test_at_256_rows_the_projections_are_compute_bound_and_attention_is_not() -> None:
    r = decode_step_rooflines(LLAMA_3_1_8B, 256, 1056, WEIGHTS, BANDWIDTH, PEAK)
    ops = r["ops"]
    assert all(ops[name]["bound"] == "compute" for name in ("qkv", "o", "gate_up", "down", "lm_head"))
    assert ops["attention"]["bound"] == "memory"
    # 2 FLOPs per weight per row: 256 rows at 750 TFLOP/s take longer than reading the weights at 4.2 TB/s.
    extra = sum(ops[n]["flops_s"] - ops[n]["bytes_s"] for n in ("qkv", "o", "gate_up", "down", "lm_head"))
    assert r["compute_s"] == pytest.approx(r["hbm_s"] + extra)
    assert r["compute_s"] > 1.1 * r["hbm_s"]


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_counting_compute_never_lowers_the_roofline(dtype_bytes: int) -> None:
    weights = dtype_bytes * WEIGHTS // 2
    for batch in (1, 2, 16, 64, 256, 512):
        r = decode_step_rooflines(LLAMA_3_1_8B, batch, 700, weights, BANDWIDTH, PEAK, dtype_bytes)
        assert r["compute_s"] >= r["hbm_s"] * (1 - 1e-12)


def test_a_prompt_counts_the_last_layers_output_projection_and_mlp_for_its_sampled_tokens_only() -> None:
    """Llama-3.1-8B: 218.1M projection weights a layer, 192.9M of them after attention (o_proj 16.8M, the
    MLP 176.2M); one sampled token of 2,048 takes those and the LM head's 525.3M."""
    per_layer, after_attention, lm_head = 218_103_808, 192_937_984, 525_336_576
    assert matmul_params(LLAMA_3_1_8B) == 32 * per_layer
    full = 2 * 2048 * 32 * per_layer
    assert prompt_matmul_flops(LLAMA_3_1_8B, 2048) == full - 2 * 2047 * after_attention + 2 * lm_head
    assert prompt_matmul_flops(LLAMA_3_1_8B, 2048) / full == pytest.approx(0.9725, abs=1e-4)
    assert prompt_matmul_flops(LLAMA_3_1_8B, 4, sampled=4) == 2 * 4 * (32 * per_layer + lm_head)
