"""FP8 weights on the CPU: checkpoints in the compressed-tensors and ModelOpt layouts load and give exactly the
logits of their dequantized weights, tensor-parallel shards carry their scales, configs are read (and refused)
as their producers write them, and `--quantization fp8` stays within a stated distance of float32."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from engine_checkpoints import CHECKPOINTS, cpu_runner  # tests/ is on sys.path: conftest.py
from fp8_accuracy import smollm2_pair
from safetensors.torch import load_file, save_file

from splitserve.bench.accuracy import accuracy, prompt_logits
from splitserve.engine.checkpoints.model_config import ModelConfig, UnsupportedModelError
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, write_checkpoint
from splitserve.engine.checkpoints.weight_loader import CheckpointError
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.layers import linear
from splitserve.engine.layers.linear import ColumnParallelLinear, CorruptWeightError, RowParallelLinear
from splitserve.engine.quantization.fp8 import (
    FP8_DTYPE,
    Fp8Scheme,
    dequantize,
    fp8_linear_reference,
    online_scheme,
    quantize_per_channel,
    scheme_from_config,
)
from splitserve.engine.runner.model_runner import ModelRunner
from splitserve.engine.tp.parallel_state import TensorParallel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

CT_DYNAMIC = {  # compressed-tensors' FP8_DYNAMIC preset, as llm-compressor writes it
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "observer": None}}},
}
CT_STATIC = json.loads(json.dumps(CT_DYNAMIC))
CT_STATIC["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
CT_STATIC["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False, observer="minmax")
MODELOPT_FILE = {"producer": {"name": "modelopt", "version": "0.29.0"},
                 "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}

# layout -> (per-channel weight scales?, static input scales?, how the config says so)
LAYOUTS = {
    "compressed-tensors-channel-dynamic": (True, False, "config"),
    "compressed-tensors-tensor-static": (False, True, "config"),
    "modelopt-hf-quant-config": (False, True, "file"),
    "modelopt-config-json": (False, True, "config"),
}


def projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def write_fp8_layout(src: Path, dst: Path, ref: Path, layout: str, channel_scale_dtype=torch.bfloat16) -> None:
    """`dst`: `src`'s checkpoint with every projection in e4m3 and its scales in `layout`; `ref`: the same
    checkpoint with those weights dequantized (float32), what an FP8 checkpoint stands for."""
    per_channel, static, where = LAYOUTS[layout]
    weights = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    gen = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if not projection(name):
            fp8[name] = deq[name] = w
            continue
        base = name[: -len(".weight")]
        if per_channel:  # compressed-tensors keeps channel scales [N, 1] in the model's dtype
            q, scale = quantize_per_channel(w)
            stored_scale = scale.to(channel_scale_dtype).reshape(-1, 1)
        else:
            amax = w.abs().amax().float()
            stored_scale = (amax / 448).reshape(1 if layout.startswith("compressed") else ())
            q = (w.float() / stored_scale).clamp(-448, 448).to(FP8_DTYPE)
        fp8[name], fp8[f"{base}.weight_scale"] = q, stored_scale
        deq[name] = dequantize(q, stored_scale.float(), torch.float32)
        if static:
            fp8[f"{base}.input_scale"] = (torch.rand((), generator=gen) * 0.02 + 0.01).reshape(
                1 if layout.startswith("compressed") else ())
        if layout.startswith("modelopt") and base.endswith(("k_proj", "v_proj")):  # KV-cache scales: unused
            fp8[f"{base}.{base[-6]}_scale"] = torch.tensor(1.0)
    config = json.loads((src / "config.json").read_text())
    for folder, tensors in ((dst, fp8), (ref, deq)):
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
    if where == "file":
        (dst / "hf_quant_config.json").write_text(json.dumps(MODELOPT_FILE))
    else:
        qc = {"compressed-tensors-channel-dynamic": CT_DYNAMIC, "compressed-tensors-tensor-static": CT_STATIC,
              "modelopt-config-json": MODELOPT_CONFIG}[layout]
        (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request) -> str:
    return request.param


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
@torch.inference_mode()
def test_fp8_checkpoint_logits_equal_its_dequantized_weights(tmp_path: Path, layout: str, arch: str) -> None:
    """Each layout, Llama (GQA, llama3 RoPE) and Qwen2 (q/k/v bias, tied head): the CPU dequantizes on load, so
    the logits are bit-for-bit those of the float32 checkpoint of the dequantized weights."""
    src = write_checkpoint(tmp_path / "src", CHECKPOINTS[arch], seed=3)
    write_fp8_layout(src, tmp_path / "fp8", tmp_path / "ref", layout)
    cfg = ModelConfig.from_folder(tmp_path / "fp8")
    assert cfg.quantization is not None and cfg.quantization.checkpoint_fp8
    assert cfg.quantization.weight_strategy == ("channel" if LAYOUTS[layout][0] else "tensor")
    assert cfg.quantization.static_input == LAYOUTS[layout][1]
    prompt = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    got = prompt_logits(*cpu_runner(tmp_path / "fp8"), prompt)
    want = prompt_logits(*cpu_runner(tmp_path / "ref"), prompt)
    assert torch.equal(got, want)


def test_fp8_checkpoint_without_a_scale_names_it(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", CHECKPOINTS["qwen2-bias-tied"], seed=3)
    write_fp8_layout(src, tmp_path / "fp8", tmp_path / "ref", "compressed-tensors-tensor-static")
    weights = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight_scale")
    save_file(weights, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\): model.layers.1.mlp.up_proj.weight_scale"):
        cpu_runner(tmp_path / "fp8")


def test_fp8_weight_with_a_nan_code_is_refused_naming_it(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", CHECKPOINTS["qwen2-bias-tied"], seed=3)
    write_fp8_layout(src, tmp_path / "fp8", tmp_path / "ref", "compressed-tensors-channel-dynamic")
    weights = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    codes = weights[name].view(torch.uint8).clone()
    codes[3, 5], codes[4, 0] = 0x7F, 0xFF  # e4m3fn's two NaN codes
    weights[name] = codes.view(FP8_DTYPE)
    save_file(weights, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(CorruptWeightError, match=rf"{name}: 2 NaN code\(s\) in an e4m3 weight"):
        cpu_runner(tmp_path / "fp8")


def test_fp8_tensor_without_a_quantization_config_is_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", CHECKPOINTS["qwen2-bias-tied"], seed=3)
    write_fp8_layout(src, tmp_path / "fp8", tmp_path / "ref", "modelopt-hf-quant-config")
    (tmp_path / "fp8" / "hf_quant_config.json").unlink()
    with pytest.raises((CheckpointError, ValueError), match=r"FP8 scale"):
        cpu_runner(tmp_path / "fp8")


def test_configs_are_read_as_their_producers_write_them(tmp_path: Path) -> None:
    assert scheme_from_config({}) is None
    ct = scheme_from_config({"quantization_config": CT_DYNAMIC})
    assert (ct.source, ct.weight_strategy, ct.activation) == ("compressed-tensors", "channel", "dynamic-token")
    assert not ct.quantizes("lm_head") and ct.quantizes("model.layers.0.mlp.down_proj")
    st = scheme_from_config({"quantization_config": CT_STATIC})
    assert (st.weight_strategy, st.activation) == ("tensor", "static-tensor")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(MODELOPT_FILE))
    mo = scheme_from_config({}, tmp_path)
    assert (mo.source, mo.weight_strategy, mo.activation) == ("modelopt", "tensor", "static-tensor")
    per_token = scheme_from_config({"quantization_config": {"quant_method": "modelopt",
                                                            "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})
    assert (per_token.weight_strategy, per_token.activation) == ("channel", "dynamic-token")
    auto_fp8 = scheme_from_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                           "ignored_layers": ["lm_head"]}})
    assert (auto_fp8.weight_strategy, auto_fp8.activation) == ("tensor", "static-tensor")
    ignored = Fp8Scheme("compressed-tensors", ignore=("re:.*layers\\.0\\..*", "lm_head"))
    assert not ignored.quantizes("model.layers.0.self_attn.q_proj") and ignored.quantizes("model.layers.1.mlp.up_proj")
    base = dict(CHECKPOINTS["qwen2-bias-tied"])
    for refused in ({"quant_method": "fp8", "weight_block_size": [128, 128]},
                    {"quant_method": "awq", "bits": 4},
                    {"quant_method": "modelopt", "quant_algo": "NVFP4"},
                    {**CT_DYNAMIC, "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}):
        with pytest.raises(UnsupportedModelError):
            ModelConfig.from_dict({**base, "quantization_config": refused})


@pytest.mark.parametrize("fp8_storage", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
def test_tensor_parallel_shards_carry_their_scales(fp8_storage: bool, per_channel: bool) -> None:
    """Two ranks of a fused column-parallel layer (three parts, each its own scale) and of a row-parallel one:
    each rank's rows of the dequantized weight are the full weight's, its scales split with the rows (column) or
    replicated (row); with FP8 storage (CUDA's layout, here on the CPU) and dequantized on load alike."""
    gen = torch.Generator().manual_seed(1)
    scheme = Fp8Scheme("compressed-tensors", weight_strategy="channel" if per_channel else "tensor",
                       activation="static-tensor")
    sizes, k = [8, 4, 4], 12
    parts = []
    for n in sizes:
        w = torch.randn(n, k, generator=gen)
        if per_channel:
            q, s = quantize_per_channel(w)
        else:
            s = (w.abs().amax() / 448).reshape(1)
            q = (w / s).to(FP8_DTYPE)
        parts.append((q, s, dequantize(q, s, torch.float32)))
    down_q, down_s = quantize_per_channel(torch.randn(6, 16, generator=gen))
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        col = ColumnParallelLinear(k, sizes, bias=False, tp=tp, dtype=torch.float32, quant=scheme,
                                   fp8_storage=fp8_storage)
        row = RowParallelLinear(16, 6, bias=False, tp=tp, dtype=torch.float32, quant=scheme, fp8_storage=fp8_storage)
        for i, (q, s, _) in enumerate(parts):  # scales first for one part: the order must not matter
            order = [("w.weight_scale", s), ("w.weight", q)] if i == 1 else [("w.weight", q), ("w.weight_scale", s)]
            for name, t in [*order, ("w.input_scale", torch.tensor([0.1 * (i + 1)]))]:
                col.load(name, t, i)
        row.load("d.weight", down_q)
        row.load("d.weight_scale", down_s)
        want_col = torch.cat([d.narrow(0, rank * (d.shape[0] // 2), d.shape[0] // 2) for _, _, d in parts])
        want_row = dequantize(down_q, down_s, torch.float32)[:, rank * 8:(rank + 1) * 8]
        for layer, want in ((col, want_col), (row, want_row)):
            if fp8_storage:
                assert layer.weight.dtype == FP8_DTYPE
                got = dequantize(layer.weight, layer.weight_scale, torch.float32)
            else:
                assert layer.weight.dtype == torch.float32 and not layer._pending
                got = layer.weight
            assert torch.equal(got, want)
        if fp8_storage:
            assert torch.equal(row.weight_scale, down_s)  # replicated
            assert col.weight_scale.shape == (sum(sizes) // 2,)
            assert torch.equal(col.input_scale, torch.tensor([0.3]))  # the largest of the fused parts'
        x = torch.randn(3, k, generator=gen)
        torch.testing.assert_close(col(x), x @ want_col.t())


@pytest.mark.parametrize("fp8_storage", [False, True])
def test_a_nan_code_in_this_rank_s_columns_is_refused_with_or_without_fp8_storage(fp8_storage: bool) -> None:
    """Checked on what the rank keeps: its columns of a row-parallel weight, where they land (FP8 storage) or
    before they are dequantized; the other rank's columns are not its to refuse."""
    scheme = Fp8Scheme("compressed-tensors", weight_strategy="channel", activation="dynamic-token")
    q, scale = quantize_per_channel(torch.randn(6, 16, generator=torch.Generator().manual_seed(2)))
    codes = q.view(torch.uint8).clone()
    codes[2, 3] = 0xFF  # in rank 0's columns (0-7)
    q = codes.view(FP8_DTYPE)
    for rank, refused in ((0, True), (1, False)):
        layer = RowParallelLinear(16, 6, bias=False, tp=TensorParallel(rank=rank, size=2), dtype=torch.float32,
                                  quant=scheme, fp8_storage=fp8_storage)
        layer.load("d.weight_scale", scale)
        if refused:
            with pytest.raises(CorruptWeightError, match=r"d.weight: 1 NaN code\(s\) in an e4m3 weight of 48 values"):
                layer.load("d.weight", q)
        else:
            layer.load("d.weight", q)


def test_16bit_weight_quantized_on_load_per_channel_over_whole_rows() -> None:
    """--quantization fp8 on a row-parallel layer: the scale of a row is its whole (unsplit) row's."""
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    w[:, 0] *= 50  # rank 0's columns hold every row's largest value
    q, s = quantize_per_channel(w)
    for rank in range(2):
        row = RowParallelLinear(16, 6, bias=False, tp=TensorParallel(rank=rank, size=2), dtype=torch.float32,
                                quant=online_scheme(), fp8_storage=True)
        row.load("d.weight", w)
        assert torch.equal(row.weight_scale, s)
        assert torch.equal(row.weight, q[:, rank * 8:(rank + 1) * 8])


# --quantization fp8 on the tiny model against float32, on random-id prompts. e4m3 rounds a weight by 2.6% rms
# (3 mantissa bits; bfloat16: 0.17%), and a random-weight model with near-tied logits feels it: measured when
# written (docs/fp8.md) KL 0.033, top-1 0.88, greedy 0.47 (dequantized on load), and with the GPU's numerics
# emulated KL 0.064, top-1 0.81, greedy 0.22 (W8A8 rows throughout) or KL 0.056, top-1 0.84, greedy 0.22 (16-bit
# decode rows). Tolerances ~2-3x those: a broken scale or layout (KL > 1) fails, rounding noise passes.
MAX_MEAN_KL = 0.1  # nats per token, KL(float32 || fp8) over every prompt position
MIN_TOP1 = 0.75  # teacher-forced positions whose argmax agrees
MIN_GREEDY = 0.15  # generated tokens equal to float32's before the first divergence, over all prompts


def fp8_runner(folder: Path, monkeypatch: pytest.MonkeyPatch | None = None, decode_rows: str = "w8a8"
               ) -> tuple[ModelRunner, KVCache]:
    """A float32 CPU runner with --quantization fp8 (`monkeypatch`: with FP8 storage and the GPU's numerics
    emulated: activations quantized per token at every row count, or past 16 rows only with `decode_rows`
    w8a16)."""
    if monkeypatch is not None:
        def emulated(x, weight, weight_scale, input_scale, bias, activation, skinny_rows, arrivals=None,
                     decode_w8a8=False):
            quantized = decode_w8a8 or x.shape[0] > skinny_rows
            return fp8_linear_reference(x, weight, weight_scale, input_scale, bias, activation if quantized else None)
        monkeypatch.setattr(linear, "fp8_storage_default", lambda: True)
        monkeypatch.setattr(linear, "fp8_linear", emulated)
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                       max_running_requests=4, quantization="fp8", fp8_decode_rows=decode_rows)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    return runner, KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 1024, runner.device)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_CONFIG, seed=0)


def test_quantization_fp8_on_the_tiny_model_stays_close_to_float32(tiny: Path, capsys) -> None:
    runner, kv = fp8_runner(tiny)
    assert runner.model_cfg.quantization == online_scheme()
    w = runner.model.layers[0].mlp.down_proj.weight
    q, s = quantize_per_channel(w)
    assert torch.equal(dequantize(q, s, torch.float32), w)  # the weights hold e4m3 values exactly
    got = accuracy(cpu_runner(tiny), (runner, kv), TINY_CONFIG["vocab_size"])
    with capsys.disabled():
        print(f"\ntiny --quantization fp8 (weights dequantized on load) vs float32: {got}")
    assert got["mean_kl"] < MAX_MEAN_KL and got["top1"] >= MIN_TOP1 and got["greedy"] >= MIN_GREEDY, got


@pytest.mark.parametrize("decode_rows", ["w8a8", "w8a16"])
def test_quantization_fp8_with_emulated_gpu_numerics(tiny: Path, decode_rows: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys) -> None:
    """FP8 storage on the CPU, each product as the GPU computes it (W8A16 up to 16 rows and per-token W8A8 past
    them; with --fp8-decode-rows w8a8, per-token W8A8 at every row count)."""
    runner, kv = fp8_runner(tiny, monkeypatch, decode_rows)
    assert runner.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert runner.model_cfg.quantization.quantizes_decode_rows == (decode_rows == "w8a8")
    got = accuracy(cpu_runner(tiny), (runner, kv), TINY_CONFIG["vocab_size"])
    with capsys.disabled():
        print(f"\ntiny --quantization fp8 --fp8-decode-rows {decode_rows} (GPU numerics emulated) vs float32: {got}")
    assert got["mean_kl"] < 1.5 * MAX_MEAN_KL and got["top1"] >= MIN_TOP1 and got["greedy"] >= MIN_GREEDY, got


@pytest.mark.slow
def test_quantization_fp8_on_smollm2_gguf(capsys) -> None:
    """SmolLM2-135M-Instruct (its Q4_1 GGUF file, dequantized then quantized to FP8 on load) against float32."""
    reference, quantized, vocab = smollm2_pair(quantization="fp8")
    got = accuracy(reference, quantized, vocab)
    with capsys.disabled():
        print(f"\nSmolLM2-135M --quantization fp8 vs float32: {got}")
    # Measured when written: KL 0.025, top-1 0.85, greedy 0.53 (random-id prompts: flat, sensitive logits).
    assert got["mean_kl"] < 0.06 and got["top1"] >= 0.75 and not math.isnan(got["mean_kl"]), got


# Passing dequantize=True over the checkpoint's own quantization_config is the point: transformers says so.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@torch.inference_mode()
def test_transformers_loads_the_compressed_tensors_checkpoint_alike(tmp_path: Path) -> None:
    """transformers (with the compressed-tensors package) on our compressed-tensors FP8 checkpoint, dequantized
    on load, gives our logits. Its scales are float32 here: compressed-tensors multiplies in the scale's dtype
    (bfloat16 scales: a bfloat16 product, 1e-3 off the float32 one we compute)."""
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    src = write_checkpoint(tmp_path / "src", CHECKPOINTS["llama-gqa-llama3rope"], seed=3)
    write_fp8_layout(src, tmp_path / "fp8", tmp_path / "ref", "compressed-tensors-channel-dynamic", torch.float32)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "fp8", dtype=torch.float32,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    except (ImportError, RuntimeError, ValueError, TypeError) as e:  # a version that cannot on the CPU
        pytest.skip(f"transformers cannot load it here: {e}")
    prompt = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    want = hf(torch.tensor([prompt])).logits[0].float()
    got = prompt_logits(*cpu_runner(tmp_path / "fp8"), prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_a_shape_and_its_fp8_twin_draw_the_same_dummy_weights_and_the_bench_states_their_accuracy() -> None:
    """--load-format dummy draws every weight in float32 from a seed per name: the FP8 twin's projections are the
    bfloat16 model's quantized per channel (within e4m3's rounding), the rest equal; bench fp8's accuracy of
    FP8 weights and FP8 KV against them is then quantization noise only (the tiny shape, CPU, float32)."""
    from splitserve.bench.fp8 import accuracy_on_shape, twin

    (plain, _), (fp8, _) = twin("tiny", "cpu"), twin("tiny", "cpu", quantization="fp8")
    assert torch.equal(plain.model.embed_tokens.weight, fp8.model.embed_tokens.weight)
    w, q = plain.model.layers[1].mlp.down_proj.weight, fp8.model.layers[1].mlp.down_proj.weight
    assert not torch.equal(w, q) and float((w - q).abs().max() / w.abs().max()) < 1 / 16
    got = accuracy_on_shape("tiny", "cpu")
    assert got["fp8_weights"]["mean_kl"] < 0.03 and got["fp8_weights"]["top1"] > 0.85, got
    assert got["fp8_kv"]["mean_kl"] < 0.03 and got["fp8_kv"]["top1"] > 0.85, got
    assert got["fp8_kv_widened_prompts"] == got["fp8_kv"]  # the CPU widens the pages either way


def test_fp8_decode_rows_comes_from_the_flag_or_the_environment_and_bad_values_are_refused(
        capsys: pytest.CaptureFixture) -> None:
    from splitserve.api.serve_config import parse_configs

    assert parse_configs([], environ={}).engine.fp8_decode_rows == "w8a8"
    assert parse_configs(["--fp8-decode-rows", "w8a16"], environ={}).engine.fp8_decode_rows == "w8a16"
    assert parse_configs([], environ={"SPLITSERVE_FP8_DECODE_ROWS": "w8a16"}).engine.fp8_decode_rows == "w8a16"
    with pytest.raises(SystemExit):
        parse_configs(["--fp8-decode-rows", "w4a8"], environ={})
    assert "--fp8-decode-rows" in capsys.readouterr().err
    # A weight-only scheme's decode rows stay 16-bit whatever the flag; so do a dynamic per-tensor scheme's.
    assert online_scheme().quantizes_decode_rows  # the default: w8a8
    assert not dataclasses.replace(online_scheme(), decode_rows="w8a16").quantizes_decode_rows
    w8a8 = dataclasses.replace(online_scheme(), decode_rows="w8a8")
    assert w8a8.quantizes_decode_rows and dataclasses.replace(w8a8, activation="static-tensor").quantizes_decode_rows
    for activation in ("none", "dynamic-tensor"):
        assert not dataclasses.replace(w8a8, activation=activation).quantizes_decode_rows
