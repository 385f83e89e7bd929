"""The Qwen-VL benchmark's FLOP count of the tower equals one derived from the tower's own weights, and its
tower and transfer parts run (on the CPU, the tiny model)."""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.bench.qwen_vl import QwenVLBenchConfig, tower_flops, tower_timing, transfer_vs_device_copy
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_qwen_vl import QWEN2_5_VL_7B, write_qwen_vl_checkpoint, write_qwen_vl_shape
from splitserve.engine.models.qwen_vl_vision import QwenVisionTower


def test_tower_flops_equal_twice_the_weights_per_row_plus_attention(tmp_path: Path) -> None:
    folder = write_qwen_vl_checkpoint(tmp_path / "q2", architecture="Qwen2VLForConditionalGeneration")
    vision = ModelConfig.from_folder(folder).vision
    tower = QwenVisionTower(vision, torch.float32)
    grid = (1, 10, 14)
    n = 140
    blocks = sum(p.numel() for name, p in tower.blocks.named_parameters() if name.endswith("weight") and p.dim() == 2)
    merger = sum(p.numel() for p in tower.merger.mlp.parameters() if p.dim() == 2)
    attention = 4 * vision.hidden_size * n * n * vision.num_layers  # no windows in Qwen2-VL
    want = 2 * n * (blocks + tower.patch_embed.proj.weight.numel()) + 2 * (n // 4) * merger + attention
    assert tower_flops(vision, grid) == want


def test_the_7b_shape_s_tower_at_1344_px(tmp_path: Path) -> None:
    vision = ModelConfig.from_folder(write_qwen_vl_shape(tmp_path / "7b")).vision
    assert vision.out_hidden_size == QWEN2_5_VL_7B["hidden_size"]
    flops = tower_flops(vision, (1, 96, 96))
    # ~0.63 G matmul weights x 9,216 patches x 2 (11.6 T), the 4 full-attention blocks' 4 d N^2 (1.7 T), the
    # 28 windowed blocks' 64-patch windows (0.08 T), the merger (0.2 T).
    assert 13.4e12 < flops < 13.9e12


def test_tower_and_transfer_parts_run_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    cfg = QwenVLBenchConfig(model="tiny-qwen2.5-vl", device="cpu", tower_sides=[40, 64], tower_iters=1, max_side=64)
    tower = tower_timing(cfg, cfg.model)
    assert [t["tokens"] for t in tower.values()] == [25, 64] and all(t["ms"] > 0 for t in tower.values())
    transfer = transfer_vs_device_copy(cfg, cfg.model)
    assert transfer["rows"] == 64 and transfer["bytes_per_item"] == 64 * 64 * 2


def test_without_mooncake_the_encoder_parts_say_they_were_skipped_and_the_rest_reports(monkeypatch, capsys) -> None:
    import importlib.util

    from splitserve.bench import qwen_vl

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real(name, *a))
    reason = qwen_vl.mooncake_missing()
    assert reason.startswith("skipped: Mooncake is not installed")
    stats = {"ttft_s": {"p50": 0.1, "p99": 0.2}, "output_tokens_per_s": 50.0, "ok": 4, "requests": 4}
    qwen_vl.print_transfer_part({"skipped": reason})
    qwen_vl.print_serving({"rates": [1.0], "unified": {1.0: stats}, "epd": {"skipped": reason}})
    out = capsys.readouterr().out
    assert "embedding transfer skipped: Mooncake" in out and "encode + prefill + decode skipped" in out
    assert "unified TTFT p50     100 ms" in out
