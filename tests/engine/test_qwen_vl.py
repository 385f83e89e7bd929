"""Qwen2-VL and Qwen2.5-VL in the engine equal transformers: the smart-resize processor, per-image token counts,
M-RoPE positions, the vision tower (2D rotary, Qwen2.5's windows, the merger) and logits with 0, 1 and 2 images
of several sizes over chunked prefill, prefix-cache hits and decode steps."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_checkpoints import cpu_runner
from PIL import Image
from safetensors.torch import load_file, save_file

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_checkpoint
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.multimodal.image_items import ImageItem, expand_image_tokens, image_digest
from splitserve.engine.multimodal.mrope import chunk_rope_positions, mrope_positions
from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor, smart_resize
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import build_forward_batch, patch_batches
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

transformers = pytest.importorskip("transformers")

ARCHS = {"qwen2-vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLForConditionalGeneration"),
         "qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = {  # rendered chat text with 0, 1 and 2 images
    0: "<|im_start|>user\nwhat is up?<|im_end|>\n<|im_start|>assistant\n",
    1: f"<|im_start|>user\n{IMAGE}describe it<|im_end|>\n<|im_start|>assistant\n",
    2: f"<|im_start|>user\nleft {IMAGE} right{IMAGE}<|im_end|>\n<|im_start|>assistant\n",
}


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Sizes that resize to different grids (wide, tall, square, tiny: scaled up to min_pixels, large: down
    to max_pixels) and modes (RGBA, grayscale)."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (40, 57, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (90, 31, 4), dtype=np.uint8), "RGBA"),
        Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8), "L"),
        Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (300, 210, 3), dtype=np.uint8)),
    ]


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory) -> tuple[Path, str]:
    arch, _ = ARCHS[request.param]
    return write_qwen_vl_checkpoint(tmp_path_factory.mktemp(request.param), seed=3, architecture=arch), arch


def hf_model(folder: Path, arch: str):
    return getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()


def hf_image_processor(folder: Path):
    """transformers' Qwen2-VL image processor on PIL (the torchvision one, picked where torchvision is
    installed, resizes differently)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(folder)


def prompt(folder: Path, n: int, seed: int = 0) -> tuple[list[int], list[ImageItem], dict[str, torch.Tensor]]:
    """The expanded prompt ids, the engine's image items (offsets, grids, patches) and transformers' inputs."""
    mc = ModelConfig.from_folder(folder)
    proc = QwenVLImageProcessor.from_folder(folder)
    images = [proc(img) for img in sample_images(seed)[:n]]
    counts = [mc.vision.tokens_for_grid(img.grid) for img in images]
    ids, offsets = expand_image_tokens(TextTokenizer(folder).encode(PROMPTS[n], add_special_tokens=False),
                                       mc.vision.image_token_id, counts, n)
    items = [ImageItem(image_digest(f"image {i} of seed {seed}".encode()), o, c, img.patches, grid=img.grid)
             for i, (o, c, img) in enumerate(zip(offsets, counts, images, strict=True))]
    hf_in = {"input_ids": torch.tensor([ids]),
             "mm_token_type_ids": (torch.tensor([ids]) == mc.vision.image_token_id).int()}
    if images:
        hf_in["pixel_values"] = torch.cat([img.patches for img in images])
        hf_in["image_grid_thw"] = torch.tensor([img.grid for img in images])
    return ids, items, hf_in


def engine_logits(runner, kv, ids: list[int], images: list[ImageItem], splits: list[int]
                  ) -> tuple[int, torch.Tensor]:
    """(cached, logits of positions cached..): the prompt's first `cached` tokens come from the prefix cache
    (pages earlier prompts left), the rest run in chunks cut at `splits`."""
    req = Request("r", list(ids), SamplingParams(), on_output=lambda _o: None)
    req.images = images
    kv.admit(req, max_prefix_tokens=len(ids) - 1)
    cached = req.kv_len = req.cached_len
    out = []
    with torch.inference_mode():
        for start, end in itertools.pairwise([cached, *[s for s in splits if s > cached], len(ids)]):
            assert kv.grow(req, end)
            chunks = [ScheduledChunk(req, start, end - start, True)]
            batch = build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device)
            batch.logits_index = torch.arange(end - start)
            if any(it.offset < end and it.end > start for it in images):
                batch.image_rows, batch.image_positions = runner.prompt_image_rows(chunks)
            batch.rope_positions = runner.rope_positions(chunks)
            out.append(runner.model(batch, runner.kv_pool))
            req.kv_len = end
    kv.release(req)
    return cached, torch.cat(out)


def test_processor_equals_transformers(checkpoint: tuple[Path, str]) -> None:
    folder, _ = checkpoint
    ours, hf = QwenVLImageProcessor.from_folder(folder), hf_image_processor(folder)
    grids = set()
    for image in sample_images():
        want = hf(images=[image], return_tensors="pt")
        got = ours(image)
        assert got.grid == tuple(want["image_grid_thw"][0].tolist())
        assert torch.equal(got.patches, want["pixel_values"])
        grids.add(got.grid)
    # Every size its own grid; the tiny one scaled up to min_pixels, the large one down to max_pixels.
    assert len(grids) == 5 and (1, 4, 6) in grids and (1, 18, 12) in grids


def test_smart_resize_bounds_and_refusals() -> None:
    assert smart_resize(448, 448, 28, 56 * 56, 28 * 28 * 1280) == (448, 448)
    h, w = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 1280)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 1280
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100, 28, 56 * 56, 28 * 28 * 1280)


def test_placeholders_and_positions_equal_transformers(checkpoint: tuple[Path, str]) -> None:
    folder, arch = checkpoint
    hf = hf_model(folder, arch)
    mc = ModelConfig.from_folder(folder)
    for n in (1, 2):
        ids, items, hf_in = prompt(folder, n)
        assert sorted({it.num_tokens for it in items}) == sorted({it.num_tokens for it in items}) and all(
            it.num_tokens == it.grid[1] * it.grid[2] // 4 for it in items)
        want, want_delta = hf.model.get_rope_index(hf_in["input_ids"], hf_in["mm_token_type_ids"],
                                                   image_grid_thw=hf_in["image_grid_thw"])
        table, delta = mrope_positions(len(ids), [(it.offset, it.grid) for it in items], 2)
        assert delta == int(want_delta) < 0
        assert torch.equal(chunk_rope_positions(table, delta, 0, len(ids) + 3)[:, :len(ids)], want[:, 0])
        # Past the prompt (decode): index + delta on all three axes, as transformers' generation.
        assert torch.equal(chunk_rope_positions(table, delta, len(ids), 3),
                           (torch.arange(len(ids), len(ids) + 3) + delta).expand(3, -1))
    assert mc.vision.tokens_for_grid((1, 10, 14)) == 35


def test_vision_tower_equals_transformers(checkpoint: tuple[Path, str]) -> None:
    folder, arch = checkpoint
    hf = hf_model(folder, arch)
    runner, _ = cpu_runner(folder, max_running=2)
    proc = QwenVLImageProcessor.from_folder(folder)
    images = [proc(img) for img in sample_images(seed=4)]
    grids = [img.grid for img in images]
    with torch.no_grad():
        want = hf.model.get_image_features(torch.cat([img.patches for img in images]),
                                           torch.tensor(grids)).pooler_output
    got = runner.encode_images([img.patches for img in images], grids)
    # Called outside a step (the encode role does): no autograd graph holds the tower's activations.
    assert not any(g.requires_grad for g in got) and not any(p.requires_grad for p in runner.model.parameters())
    assert [g.shape[0] for g in got] == [w.shape[0] for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    # A patch budget smaller than any image: one tower pass per image, the same rows.
    assert len(patch_batches([img.patches.shape[0] for img in images], 1)) == len(images) > 1
    runner.cfg = dataclasses.replace(runner.cfg, vision_batch_patches=1)
    for g, w in zip(runner.encode_images([img.patches for img in images], grids), want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_patch_batches_keep_each_pass_within_the_budget() -> None:
    assert patch_batches([9216, 9216, 1024, 1024, 4096], 16384) == [range(0, 1), range(1, 5)]
    assert patch_batches([20000, 1], 16384) == [range(0, 1), range(1, 2)]  # past the budget: alone
    assert patch_batches([1, 20000, 1], 16384) == [range(0, 1), range(1, 2), range(2, 3)]
    assert patch_batches([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert patch_batches([], 8) == []


@pytest.mark.parametrize("layout", ["hub", "transformers-save_pretrained", "transformers-4.5x"])
def test_logits_equal_transformers_for_0_1_2_images(checkpoint: tuple[Path, str], tmp_path: Path,
                                                    layout: str) -> None:
    """hub: our writer's folder (flat config, `visual.`); transformers-save_pretrained: saved by the installed
    transformers (nested text_config); transformers-4.5x: `model.language_model.` / `model.visual.` names."""
    folder, arch = checkpoint
    hf = hf_model(folder, arch)
    if layout == "transformers-save_pretrained":
        folder = tmp_path / "saved"
        hf.save_pretrained(folder)
        for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
            (folder / f).write_bytes((checkpoint[0] / f).read_bytes())
    elif layout == "transformers-4.5x":
        folder = tmp_path / "v4"
        folder.mkdir()
        for f in checkpoint[0].iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                    "model." + k if k.startswith("visual.") else k): v
                   for k, v in load_file(checkpoint[0] / "model.safetensors").items()}
        save_file(renamed, str(folder / "model.safetensors"))
    runner, kv = cpu_runner(folder, max_running=2)
    for n in (0, 1, 2):
        ids, items, hf_in = prompt(folder, n, seed=n)
        with torch.no_grad():
            want = hf(**hf_in).logits[0]
        # Chunk boundaries inside the first image and between the images.
        splits = sorted({items[0].offset + 5, items[-1].offset + 3}) if n else [7]
        cached, got = engine_logits(runner, kv, ids, items, splits)
        assert cached == (0 if n == 0 else 4)  # the next prompt reuses the page of "<|im_start|>user\n"
        torch.testing.assert_close(got, want[cached:], atol=2e-4, rtol=2e-4)
        assert torch.equal(got.argmax(-1), want[cached:].argmax(-1))


def test_prefix_cache_hit_past_an_image_keeps_its_positions(checkpoint: tuple[Path, str]) -> None:
    """The same two-image prompt twice: the second run starts from cached pages past the first image (the
    positions of the tokens it computes depend on both images' grids), and its logits still equal transformers'.
    The same tokens with other images share only the text before the first image."""
    folder, arch = checkpoint
    hf = hf_model(folder, arch)
    runner, kv = cpu_runner(folder, max_running=2)
    ids, items, hf_in = prompt(folder, 2, seed=7)
    with torch.no_grad():
        want = hf(**hf_in).logits[0]
    first_cached, first = engine_logits(runner, kv, ids, items, [items[1].offset + 2])
    assert first_cached == 0
    torch.testing.assert_close(first, want, atol=2e-4, rtol=2e-4)
    copies = [ImageItem(it.digest, it.offset, it.num_tokens, it.pixels, grid=it.grid) for it in items]
    for it, source in zip(copies, items, strict=True):  # the first run moved the pixels into rows
        it.pixels, it.embedding = None, source.embedding
    cached, again = engine_logits(runner, kv, ids, copies, [])
    assert cached > items[1].end  # both images' tokens came from the cache
    torch.testing.assert_close(again, want[cached:], atol=2e-4, rtol=2e-4)
    others = [ImageItem(image_digest(b"another image"), it.offset, it.num_tokens, grid=it.grid,
                        embedding=it.embedding) for it in items]
    cached, _ = engine_logits(runner, kv, ids, others, [])
    assert cached == items[0].offset // 4 * 4
    assert kv.usage().locked == 0 and kv.usage().slots_in_use == 0


def test_tiny_qwen_vl_is_a_model_name(tmp_path: Path, monkeypatch) -> None:
    from splitserve.engine.checkpoints.model_names import check_model_exists, resolve_model_path

    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    check_model_exists("tiny-qwen2.5-vl")  # nothing written for the check
    assert not list(tmp_path.iterdir())
    folder = resolve_model_path("tiny-qwen2.5-vl")
    mc = ModelConfig.from_folder(folder)
    assert mc.mrope and mc.vision.is_qwen2_5 and resolve_model_path("tiny-qwen2.5-vl") == folder


def test_decode_row_offsets_between_and_past_images() -> None:
    """A one-token chunk rotates at position + offset: text between two images at its table position, a decode
    row past the last image at index + delta; a text-only request's rows at 0."""
    from splitserve.engine.multimodal.mrope import decode_rope_offsets

    ids = [1] * 3 + [262] * 6 + [1] * 2 + [262] * 4 + [1] * 3  # images of 2x3 and 2x2 merged blocks
    req = Request("r", ids, SamplingParams(), on_output=lambda _o: None)
    req.images = [ImageItem("a" * 64, 3, 6, grid=(1, 4, 6)), ImageItem("b" * 64, 11, 4, grid=(1, 4, 4))]
    text = Request("t", [1] * 5, SamplingParams(), on_output=lambda _o: None)
    table, delta = mrope_positions(len(ids), [(3, (1, 4, 6)), (11, (1, 4, 4))], 2)
    chunks = [ScheduledChunk(req, 9, 1, False), ScheduledChunk(req, 16, 1, True), ScheduledChunk(req, 25, 1, True),
              ScheduledChunk(text, 5, 1, True)]
    want = [int(chunk_rope_positions(table, delta, c.start, 1)[0, 0]) - c.start for c in chunks[:3]]
    assert decode_rope_offsets(chunks, 2) == [*want, 0]
    assert want == [-3, -5, -5] and delta == -5  # 3 text, image 1 spans 3 positions for 6 tokens, ...
