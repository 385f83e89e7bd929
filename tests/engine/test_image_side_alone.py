"""An encode engine builds its multimodal model's image side alone: no text model in memory, the checkpoint's
text tensors skipped on load, and the same embedding rows as the whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_checkpoint
from splitserve.engine.checkpoints.weight_loader import CheckpointError, load_weights
from splitserve.engine.config import EngineConfig
from splitserve.engine.models import build_model
from splitserve.engine.runner.model_runner import ENCODER_KV_PAGES, ModelRunner


def runner(folder: Path, role: str, load_format: str = "safetensors") -> ModelRunner:
    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                       max_running_requests=2, role=role, load_format=load_format)
    return ModelRunner(cfg, folder, ModelConfig.from_folder(folder))


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", ["qwen2.5-vl", "llava"])
def test_an_encoder_holds_the_image_side_alone_and_encodes_as_the_whole_model(family: str, tmp_path: Path) -> None:
    if family == "llava":
        from splitserve.engine.multimodal.image_processor import ClipImageProcessor

        folder = write_llava_checkpoint(tmp_path / family, seed=3)
        proc = ClipImageProcessor.from_folder(folder)
        pixels = [proc(image(1, (40, 57))), proc(image(2, (33, 33)))]
        grids = None
    else:
        from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor

        folder = write_qwen_vl_checkpoint(tmp_path / family, seed=3)
        proc = QwenVLImageProcessor.from_folder(folder)
        items = [proc(image(1, (40, 57))), proc(image(2, (90, 31)))]
        pixels, grids = [i.patches for i in items], [i.grid for i in items]
    whole, encoder = runner(folder, "unified"), runner(folder, "encode")
    assert encoder.model.language_model is None and not encoder.cfg.runs_text
    image_side = sum(parameter_count(m) for m in whole.model.image_modules().values())
    assert parameter_count(encoder.model) == image_side < parameter_count(whole.model)
    assert encoder.kv_shape.num_pages == ENCODER_KV_PAGES and encoder.decode_graphs is None
    with torch.no_grad():
        want, got = whole.encode_images(pixels, grids), encoder.encode_images(pixels, grids)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(RuntimeError, match="image side alone"):
        encoder.model.layers  # noqa: B018 - the text side is not there to run
    # Random weights (benchmarks) are drawn per name: the encoder's image side is the whole model's.
    whole, encoder = runner(folder, "unified", "dummy"), runner(folder, "encode", "dummy")
    for name, module in whole.model.image_modules().items():
        mine = dict(getattr(encoder.model, name).named_parameters())
        assert all(torch.equal(p, mine[n]) for n, p in module.named_parameters())


def test_the_image_side_still_refuses_a_checkpoint_that_lacks_its_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_qwen_vl_checkpoint(tmp_path / "qwen", seed=3)
    tensors = load_file(folder / "model.safetensors")
    dropped = next(name for name in tensors if name.startswith("visual."))
    save_file({k: v for k, v in tensors.items() if k != dropped}, folder / "model.safetensors")
    cfg = ModelConfig.from_folder(folder)
    with pytest.raises(CheckpointError, match="lacks 1 tensor"):
        load_weights(build_model(cfg, image_side_only=True), folder, tied_lm_head=cfg.tie_word_embeddings)


def test_a_text_model_has_no_image_side_to_build() -> None:
    from splitserve.engine.checkpoints.tiny_model import tiny_model_folder

    folder = tiny_model_folder()
    with pytest.raises(ValueError, match="takes no images"):
        build_model(ModelConfig.from_folder(folder), image_side_only=True)


def test_an_encode_engine_refuses_text_generation_with_a_clear_error(tmp_path: Path) -> None:
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import GenerationFailed, generate_tokens
    from splitserve.engine.sampling_params import SamplingParams

    folder = write_qwen_vl_checkpoint(tmp_path / "qwen", seed=3)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32", role="encode"))
    assert engine.cfg.max_running_requests == 1  # it decodes nothing: one sampler row
    engine.start()
    try:
        for prompt in ([1, 2, 3], list(range(1, 60))):  # short, and longer than its two KV pages
            with pytest.raises(GenerationFailed, match=r"image side alone .* text generation goes to"):
                generate_tokens(engine, [prompt], SamplingParams(max_new_tokens=2, temperature=0.0))
        assert engine.failure is None and not engine.requests
    finally:
        engine.stop()
