"""Weight loading fails clearly on missing, extra or mis-shaped tensors; configs are validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_checkpoints import write
from safetensors.torch import load_file, save_file

from splitserve.engine.checkpoints.model_config import ModelConfig, UnsupportedModelError
from splitserve.engine.checkpoints.weight_loader import CheckpointError
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.linear import WeightShapeError
from splitserve.engine.runner.model_runner import ModelRunner


def runner_for(folder: Path) -> ModelRunner:
    cfg = EngineConfig(model=str(folder), device="cpu", max_total_tokens=64, page_size=4)
    return ModelRunner(cfg, folder, ModelConfig.from_folder(folder))


def rewrite_weights(folder: Path, change) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    folder = write("qwen2-bias-tied", tmp_path)
    rewrite_weights(folder, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\): model.layers.1.mlp.down_proj.weight"):
        runner_for(folder)


def test_mis_shaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    folder = write("qwen2-bias-tied", tmp_path)
    rewrite_weights(folder, lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(5, 64)}))
    with pytest.raises(WeightShapeError, match=r"k_proj.weight: expected shape \(32, 64\), checkpoint has \(5, 64\)"):
        runner_for(folder)


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    folder = write("qwen2-bias-tied", tmp_path)
    rewrite_weights(folder, lambda w: w.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor .model\.layers\.0\.mystery\.weight."):
        runner_for(folder)


def test_weights_split_across_several_files_load(tmp_path: Path) -> None:
    folder = write("qwen2-bias-tied", tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    names = sorted(weights)
    (folder / "model.safetensors").unlink()
    save_file({n: weights[n] for n in names[: len(names) // 2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[len(names) // 2:]}, str(folder / "model-00002-of-00002.safetensors"))
    runner = runner_for(folder)
    torch.testing.assert_close(runner.model.norm.weight, weights["model.norm.weight"])


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    folder = write("qwen2-bias-tied", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(cfg)


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="--page-size"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="--mem-fraction"):
        EngineConfig(mem_fraction=1.5)
