"""FP8 products on CUDA against the dequantized reference (skipped without CUDA): the skinny kernels at decode
rows (W8A16: exact math, bfloat16 rounding of the output; W8A8: rows quantized as the prompt path's), the
per-token / static W8A8 GEMM past them (FP8 tolerance), CUDA-graph capture, row invariance, K parts, and a
model with --quantization fp8 against bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.quantization.fp8 import fp8_linear, fp8_linear_reference, quantize_per_channel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Llama-3.1-8B's projections (N, K): qkv, o_proj, gate_up, down_proj
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def operands(n: int, k: int, rows: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q, scale = quantize_per_channel(w)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    return x, q, scale


def e4m3_products() -> bool:
    from splitserve.engine.quantization.fp8_cuda import e4m3_products

    return e4m3_products(torch.device("cuda"))


needs_e4m3_products = pytest.mark.skipif(not torch.cuda.is_available() or not e4m3_products(),
                                         reason="needs e4m3 tensor cores (compute capability 8.9+)")


@pytest.mark.parametrize("shape", SHAPES, ids=["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 256, 2048])
def test_fp8_linear_matches_the_dequantized_reference(shape: tuple[int, int], rows: int) -> None:
    n, k = shape
    x, q, scale = operands(n, k, rows)
    got = fp8_linear(x, q, scale, None, None, "dynamic-token", skinny_rows=16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    if rows <= 16 and e4m3_products():  # W8A8 decode rows: the rows quantized per token as past them
        w8a8 = fp8_linear(x, q, scale, None, None, "dynamic-token", skinny_rows=16, decode_w8a8=True)
        # the e4m3 tensor cores keep fewer bits in their own accumulation (over 512 of K at a time)
        assert relative_error(w8a8, fp8_linear_reference(x, q, scale, None, None, "dynamic-token")) < 6e-3
    if rows <= 16:  # the skinny kernel: W8A16, float32 accumulation; only the output's bfloat16 rounding differs
        want = fp8_linear_reference(x, q, scale, None, None, None)
        assert relative_error(got, want) < 4e-3
    else:  # activations quantized per token the same way; the GEMM accumulates in float32
        want = fp8_linear_reference(x, q, scale, None, None, "dynamic-token")
        assert relative_error(got, want) < 1e-2
        # and against the unquantized product: e4m3 on both operands, ~3.7% rms
        assert relative_error(got, x.float() @ (q.float() * scale[:, None]).t()) < 6e-2


@pytest.mark.parametrize("decode_w8a8", [False, True])
@pytest.mark.parametrize("rows", [4, 300])
def test_static_input_scale_and_bias(rows: int, decode_w8a8: bool) -> None:
    if decode_w8a8 and not e4m3_products():
        pytest.skip("needs e4m3 tensor cores")
    x, q, scale = operands(1024, 2048, rows, seed=1)
    input_scale = (x.float().abs().amax() / 448).reshape(1)
    bias = torch.randn(1024, device="cuda").to(torch.bfloat16)
    got = fp8_linear(x, q, scale, input_scale, bias, "static-tensor", skinny_rows=16, decode_w8a8=decode_w8a8)
    quantized = rows > 16 or decode_w8a8
    want = fp8_linear_reference(x, q, scale, input_scale, bias, "static-tensor" if quantized else None)
    assert relative_error(got, want) < 1e-2


def test_float32_rows_take_the_skinny_kernel_at_any_count() -> None:
    x, q, scale = operands(512, 1024, 40, seed=2)
    x = x.float()
    got = fp8_linear(x, q, scale, None, None, "dynamic-token", skinny_rows=16)
    want = fp8_linear_reference(x, q, scale, None, None, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decode_w8a8", [False, True])
def test_skinny_rows_do_not_depend_on_the_row_count(decode_w8a8: bool) -> None:
    x, q, scale = operands(4096, 4096, 16, seed=3)
    alone = fp8_linear(x[:1], q, scale, None, None, "dynamic-token", skinny_rows=16, decode_w8a8=decode_w8a8)
    together = fp8_linear(x, q, scale, None, None, "dynamic-token", skinny_rows=16, decode_w8a8=decode_w8a8)
    assert torch.equal(alone[0], together[0])


@pytest.mark.parametrize("decode_w8a8", [False, True])
@pytest.mark.parametrize("rows", [1, 256])
def test_fp8_linear_replays_in_a_cuda_graph(rows: int, decode_w8a8: bool) -> None:
    x, q, scale = operands(4096, 4096, rows, seed=4)
    static_x = x.clone()

    def product(rows_in: torch.Tensor) -> torch.Tensor:
        return fp8_linear(rows_in, q, scale, None, None, "dynamic-token", skinny_rows=16, decode_w8a8=decode_w8a8)

    eager = product(static_x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        product(static_x)  # warm (Triton compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    want = product(x * 2)
    assert torch.equal(out, want) and not torch.equal(out, eager)


@needs_e4m3_products
@pytest.mark.parametrize("shape", SHAPES, ids=["qkv", "o", "gate_up", "down"])
def test_e4m3_rows_kernel_adds_its_k_parts_in_order_whoever_arrives_last(shape: tuple[int, int]) -> None:
    """The W8A8 decode kernel (weight on the wide side): its own launch against the prompt path's GEMM, K in 1-4
    parts within float32 reassociation of one another, the last-arriving part's sum the second kernel's bits
    over many launches and graph replays at 1-32 rows (the counters back at zero), each row's bits its own, and
    a bias added once."""
    from splitserve.engine.quantization.fp8_cuda import (
        arrival_counters,
        quantize_rows,
        scaled_mm_quantized,
        skinny_fp8_rows,
        skinny_rows_launch,
    )

    n, k = shape
    x, q, scale = operands(n, k, 32, seed=8)
    xq, xs = quantize_rows(x, "dynamic-token", None)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    engine = skinny_rows_launch(n, k)
    assert engine[0] >= 64 and skinny_rows_launch(n, k, max_rows=1280)[4] == 1
    want = fp8_linear_reference(x, q, scale, None, bias, "dynamic-token")
    gemm = scaled_mm_quantized(xq, xs, q, scale, torch.bfloat16) + bias
    got = skinny_fp8_rows(xq, xs, q, scale, bias, torch.bfloat16)
    assert relative_error(got, want) < 6e-3 and relative_error(got, gemm) < 6e-3
    arrivals = arrival_counters(n, "cuda")
    for splits in (1, 2, 3, 4):
        launch = (*engine[:4], splits)
        whole = skinny_fp8_rows(xq, xs, q, scale, bias, torch.bfloat16, launch=launch)
        assert relative_error(whole, got) < 2e-3
        for rows in (1, 9, 16, 17, 32):
            second = skinny_fp8_rows(xq[:rows], xs[:rows], q, scale, bias, torch.bfloat16, launch=launch)
            assert torch.equal(second, whole[:rows])  # row-local
            for _ in range(10):
                last = skinny_fp8_rows(xq[:rows], xs[:rows], q, scale, bias, torch.bfloat16, launch=launch,
                                       arrivals=arrivals)
                assert torch.equal(last, second)
            assert int(arrivals.count_nonzero()) == 0
    static_q, static_s = xq[:4].clone(), xs[:4].clone()
    launch = (*engine[:4], 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_fp8_rows(static_q, static_s, q, scale, bias, torch.bfloat16, launch=launch, arrivals=arrivals)
    for _ in range(30):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_fp8_rows(static_q, static_s, q, scale, bias, torch.bfloat16, launch=launch))
    assert int(arrivals.count_nonzero()) == 0
    with pytest.raises(ValueError, match="at least 64"):
        skinny_fp8_rows(xq, xs, q, scale, None, torch.bfloat16, launch=(32, 256, 4, 3, 1))


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("shape", [(4096, 14336), (6144, 4096)], ids=["down", "qkv"])
def test_skinny_kernel_with_k_split_adds_the_parts_in_order(shape: tuple[int, int], splits: int) -> None:
    """K split in parts (more programs for a narrow product): the unsplit sum to float32 reassociation, bias
    and scale applied once, a row's bits independent of the row count, and the same bits replayed in a graph
    (the parts' scratch tensor comes from the graph's pool)."""
    from splitserve.engine.quantization.fp8_cuda import skinny_fp8, skinny_launch

    n, k = shape
    x, q, scale = operands(n, k, 9, seed=5)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    launch = (*skinny_launch(n, k, x.dtype)[:4], splits)
    assert skinny_launch(n, k, x.dtype)[4] > 1 and skinny_launch(n, k, x.dtype, max_rows=1280)[4] == 1
    whole = skinny_fp8(x, q, scale, bias, launch=(*launch[:4], 1))
    split = skinny_fp8(x, q, scale, bias, launch=launch)
    assert relative_error(split, whole) < 2e-3
    assert relative_error(split, fp8_linear_reference(x, q, scale, None, bias, None)) < 4e-3
    assert torch.equal(skinny_fp8(x[:1], q, scale, bias, launch=launch)[0], split[0])
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_fp8(static_x, q, scale, bias, launch=launch)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, split)


@pytest.mark.parametrize("splits", [2, 3, 6])
@pytest.mark.parametrize("shape", [(4096, 14336), (6144, 4096), (28672, 4096)], ids=["down", "qkv", "gate_up"])
def test_skinny_kernel_last_part_adds_the_parts_as_the_second_kernel_does(shape: tuple[int, int],
                                                                          splits: int) -> None:
    """With a layer's arrival counters the last part of each tile to finish adds the parts: the second kernel's
    bits exactly, over many launches (parts finishing in any order), in a graph replayed many times, at 1-32
    rows; the counters are back at zero after each launch."""
    from splitserve.engine.quantization.fp8_cuda import arrival_counters, skinny_fp8, skinny_launch

    n, k = shape
    x, q, scale = operands(n, k, 32, seed=7)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    launch = (*skinny_launch(n, k, x.dtype)[:4], splits)
    arrivals = arrival_counters(n, "cuda")
    for rows in (1, 9, 16, 17, 32):
        want = skinny_fp8(x[:rows], q, scale, bias, launch=launch)
        for _ in range(20):
            assert torch.equal(skinny_fp8(x[:rows], q, scale, bias, launch=launch, arrivals=arrivals), want)
        assert int(arrivals.count_nonzero()) == 0
    static_x = x[:4].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_fp8(static_x, q, scale, bias, launch=launch, arrivals=arrivals)
    want = skinny_fp8(static_x, q, scale, bias, launch=launch)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and int(arrivals.count_nonzero()) == 0
    with pytest.raises(ValueError, match="arrival counters"):
        skinny_fp8(x, q, scale, bias, launch=launch, arrivals=arrivals[:1])


@torch.inference_mode()
def test_quantization_fp8_model_on_cuda_stays_close_to_bfloat16(tmp_path: Path) -> None:
    """The tiny model in bfloat16 on CUDA, --quantization fp8 (decode graphs captured, warmed up) against the
    same model unquantized: the CPU test's tolerances (tests/engine/test_fp8.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # the CPU test's helpers, whatever pytest's import mode
    from test_fp8 import MAX_MEAN_KL, MIN_TOP1, accuracy

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    folder = write_checkpoint(tmp_path / "tiny", TINY_CONFIG, seed=0)
    sides = []
    for quantization in ("auto", "fp8"):
        cfg = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=4, max_total_tokens=4096,
                           context_length=1024, chunked_prefill_size=512, max_running_requests=4,
                           quantization=quantization)  # room for warm_up's prompts
        runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
        kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 1024, runner.device)
        runner.capture_decode_graphs(kv.page_table, kv.padding_slot)
        runner.warm_up(kv.page_table)
        sides.append((runner, kv))
    assert sides[1][0].model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    got = accuracy(sides[0], sides[1], TINY_CONFIG["vocab_size"])
    print(f"tiny bf16 --quantization fp8 vs bf16 on CUDA: {got}")
    assert got["mean_kl"] < 1.5 * MAX_MEAN_KL and got["top1"] >= MIN_TOP1, got


@pytest.mark.parametrize("activation", ["dynamic-token", "static-tensor"])
@pytest.mark.parametrize("width", [4096, 20480])
def test_quantize_rows_takes_torch_s_scales_and_rounds_as_torch_does(width: int, activation: str) -> None:
    """Per-row quantization against torch's arithmetic, one pass (4,096) and two (20,480, past ONE_PASS_MAX): the
    scales bit for bit; the e4m3 values the same but where a division rounds the other way (at most one e4m3
    step: 1/8 of the value), and at most one in a thousand."""
    from splitserve.engine.quantization.fp8 import FP8_MAX, MIN_SCALE
    from splitserve.engine.quantization.fp8_cuda import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(33, width, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    static = torch.tensor([0.02], device="cuda") if activation == "static-tensor" else None
    q, s = quantize_rows(x, activation, static)
    want_s = (static.reshape(1, 1).expand(33, 1) if static is not None
              else (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE))
    assert torch.equal(s, want_s)
    got, want = q.float(), (x.float() / want_s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    differ = got != want
    assert differ.float().mean().item() <= 1e-3
    assert ((got - want).abs()[differ] <= want.abs()[differ] / 8 + 2.0 ** -9).all()


@pytest.mark.parametrize(("activation", "width"), [("dynamic-token", 14336), ("static-tensor", 14336),
                                                   ("none", 14336), ("dynamic-token", 20480)])
@pytest.mark.parametrize("rows", [17, 300, 2048])
def test_swiglu_quantized_is_silu_and_mul_then_quantize_rows(rows: int, activation: str, width: int) -> None:
    """The MLP's fused SwiGLU-to-e4m3 kernel gives the bits of the two kernels it replaces, and the down
    projection's output from it equals the unfused layer's; rows held whole (14,336) and read in two passes
    (20,480, past fp8_cuda.ONE_PASS_MAX)."""
    from splitserve.engine.layers.fused_triton import silu_and_mul
    from splitserve.engine.quantization.fp8 import swiglu_quantized
    from splitserve.engine.quantization.fp8_cuda import quantize_rows, scaled_mm_linear, scaled_mm_quantized

    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    scale = torch.tensor([0.01], device="cuda") if activation == "static-tensor" else None
    q, s = swiglu_quantized(gate_up, activation, scale)
    h = silu_and_mul(gate_up)
    q0, s0 = quantize_rows(h, "dynamic-token" if activation == "none" else activation, scale)
    assert torch.equal(s, s0) and torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    _, wq, wscale = operands(4096, width, 1, seed=3)
    fused = scaled_mm_quantized(q, s, wq, wscale, torch.bfloat16)
    assert torch.equal(fused, scaled_mm_linear(h, wq, wscale, scale, None, activation))


@torch.inference_mode()
@pytest.mark.parametrize("decode_rows", ["w8a8", "w8a16"])
@pytest.mark.parametrize("rows", [1, 16, 17, 512])
def test_fp8_mlp_takes_the_fused_swiglu_where_its_rows_are_quantized(rows: int, decode_rows: str,
                                                                      tmp_path: Path) -> None:
    """An FP8 MLP of the 8B shape built on CUDA (its layers' arrival counters registered): its output equals the
    unfused down(silu_and_mul(gate_up)) at every row count, and the fused path is taken past the skinny rows and,
    with W8A8 decode rows (on e4m3 tensor cores), up to them too."""
    import dataclasses

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder
    from splitserve.engine.layers.activation import silu_and_mul
    from splitserve.engine.models.llama import LlamaMLP
    from splitserve.engine.quantization.fp8 import online_scheme
    from splitserve.engine.tp.parallel_state import SINGLE

    cfg = ModelConfig.from_folder(write_shape_folder("llama-3.1-8b", tmp_path))
    with torch.device("cuda"):
        scheme = dataclasses.replace(online_scheme(), decode_rows=decode_rows)
        mlp = LlamaMLP(dataclasses.replace(cfg, quantization=scheme), SINGLE, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        assert layer.fp8 and layer.arrivals is not None and int(layer.arrivals.count_nonzero()) == 0
        layer.init_from(torch.randn(layer.weight.shape, device="cuda", generator=gen) * 0.02)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    gate_up = mlp.gate_up_proj(x)
    quantized = rows > mlp.down_proj.skinny_rows or (decode_rows == "w8a8" and e4m3_products())
    assert mlp.down_proj.takes_quantized_rows(gate_up) == quantized
    assert torch.equal(mlp(x), mlp.down_proj(silu_and_mul(gate_up)))


@pytest.mark.parametrize("activation", ["dynamic-token", "static-tensor"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [17, 2048, 8192])
def test_rmsnorm_quantize_is_add_rmsnorm_then_quantize_rows(rows: int, residual: bool, activation: str) -> None:
    """The fused norm-to-e4m3 kernel gives add_rmsnorm's new residual bit for bit (in place where asked), and
    the e4m3 rows of add_rmsnorm then quantize_rows but for the few that the row's sum of squares, added in
    another order by the fused kernel, moves across a rounding boundary: a handful in millions, one e4m3 step
    each (measured on an H100: 0 at 17 rows, 1 at 2,048, 4 at 8,192 rows of 4,096)."""
    from splitserve.engine.layers.fused_triton import add_rmsnorm
    from splitserve.engine.quantization.fp8_cuda import quantize_rows, rmsnorm_quantize

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    r = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16) if residual else None
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).to(torch.bfloat16)
    scale = torch.tensor([0.02], device="cuda") if activation == "static-tensor" else None
    normed, new_residual = add_rmsnorm(x, w, 1e-5, r)
    q0, s0 = quantize_rows(normed, activation, scale)
    in_place = r.clone() if r is not None else None
    q, s, got_residual = rmsnorm_quantize(x, w, 1e-5, in_place, in_place, activation, scale)
    assert torch.equal(s, s0)
    codes, codes0 = q.view(torch.uint8).int(), q0.view(torch.uint8).int()
    differ = codes != codes0
    assert int(differ.sum()) <= max(1, rows * 4096 // 1_000_000), int(differ.sum())
    same_sign = (codes & 0x80) == (codes0 & 0x80)
    assert bool((same_sign & ((codes & 0x7F) - (codes0 & 0x7F)).abs().le(1))[differ].all())  # adjacent codes
    if residual:
        assert got_residual is not None and got_residual.data_ptr() == in_place.data_ptr()
        assert torch.equal(got_residual, new_residual)
    else:
        assert got_residual is None


@torch.inference_mode()
@pytest.mark.parametrize("decode_rows", ["w8a8", "w8a16"])
@pytest.mark.parametrize("rows", [1, 16, 17, 512])
def test_fp8_decoder_layer_feeds_its_projections_from_the_norm_in_e4m3(rows: int, decode_rows: str,
                                                                       tmp_path: Path) -> None:
    """An FP8 decoder layer of the 8B shape on CUDA: where its rows are quantized (past the skinny rows; up to
    them with W8A8 decode rows) its projections take their inputs from the fused norm-to-e4m3 kernel (the
    attention input and the MLP alike), elsewhere the norms' 16-bit rows, with the new residual either way; the
    output projection's decode rows are quantized by a kernel of their own."""
    import dataclasses

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder
    from splitserve.engine.layers.rotary import RotaryEmbedding
    from splitserve.engine.models.llama import LlamaDecoderLayer
    from splitserve.engine.quantization.fp8 import online_scheme
    from splitserve.engine.quantization.fp8_cuda import rmsnorm_quantize
    from splitserve.engine.tp.parallel_state import SINGLE

    cfg = dataclasses.replace(ModelConfig.from_folder(write_shape_folder("llama-3.1-8b", tmp_path)),
                              quantization=dataclasses.replace(online_scheme(), decode_rows=decode_rows))
    with torch.device("cuda"):
        rotary = RotaryEmbedding(cfg.head_dim, 4096, cfg.rope_theta, cfg.rope_scaling)
        layer = LlamaDecoderLayer(cfg, 0, rotary, SINGLE, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        proj.init_from(torch.randn(proj.weight.shape, device="cuda", generator=gen) * 0.02)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.copy_(1 + 0.1 * torch.randn(4096, device="cuda", generator=gen))
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    attn_out = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    qkv_proj, o_proj, mlp = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp
    fused = rows > qkv_proj.skinny_rows or (decode_rows == "w8a8" and e4m3_products())
    assert qkv_proj.takes_quantized_rows(x) == fused and mlp.gate_up_proj.takes_quantized_rows(x) == fused
    qkv, new_residual = layer.attention_input(x, residual.clone())
    out, mlp_residual = layer.after_attention(attn_out, residual.clone())
    normed, expected_residual = layer.input_layernorm(x, residual.clone())
    h = o_proj(attn_out)
    mlp_normed, expected_mlp_residual = layer.post_attention_layernorm(h, residual.clone())
    assert torch.equal(new_residual, expected_residual) and torch.equal(mlp_residual, expected_mlp_residual)
    if rows <= o_proj.skinny_rows and decode_rows == "w8a8" and e4m3_products():
        from splitserve.engine.quantization.fp8_cuda import quantize_rows

        aq, a_scales = quantize_rows(attn_out, "dynamic-token", None)
        assert torch.equal(h, o_proj.quantized_product(aq, a_scales, torch.bfloat16, None))
    if fused:
        scheme = online_scheme().activation
        xq, xs, _ = rmsnorm_quantize(x, layer.input_layernorm.weight, cfg.rms_norm_eps, residual.clone(), None,
                                     scheme, None)
        assert torch.equal(qkv, qkv_proj.forward_quantized(xq, xs, torch.bfloat16))
        hq, hs, _ = rmsnorm_quantize(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps, residual.clone(),
                                     None, scheme, None)
        assert torch.equal(out, mlp.forward_quantized(hq, hs, torch.bfloat16))
    else:
        assert torch.equal(qkv, qkv_proj(normed)) and torch.equal(out, mlp(mlp_normed))
