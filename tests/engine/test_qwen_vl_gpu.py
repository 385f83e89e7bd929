"""Qwen2.5-VL on the GPU: with CUDA graphs and the overlap scheduler (decode rows of image requests shifted by
their M-RoPE offset inside the graphs), greedy output equals eager and transformers `generate`; the vision tower
on the GPU equals transformers' on the CPU. Float32, so no rounding separates the paths.

Runs only where CUDA is (an H200, say); CI has no GPU and skips it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_checkpoint
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.multimodal.image_items import ImageItem, expand_image_tokens, image_digest
from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor
from splitserve.engine.offline import generate_tokens
from splitserve.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VISION = [260, 262, 261]  # <|vision_start|> <|image_pad|> <|vision_end|>
SIZES = [[], [(57, 40)], [(31, 90)], [(150, 120), (10, 6)], [(57, 40)]]  # images of each prompt (w, h)
MAX_NEW = 12


def prompts(folder: Path) -> tuple[list[list[int]], list[list[ImageItem]]]:
    """Token prompts (text bytes around each image's placeholder, widened to its grid) and their image items."""
    mc = ModelConfig.from_folder(folder)
    proc = QwenVLImageProcessor.from_folder(folder)
    all_ids, all_items = [], []
    for n, sizes in enumerate(SIZES):
        rng = np.random.default_rng(n)
        images = [proc(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in sizes]
        ids = [258, *b"user\n"]
        for _ in images:
            ids += [*VISION, *b" and "]
        ids += [*f"prompt {n}".encode(), 259, 258, *b"assistant\n"]
        counts = [mc.vision.tokens_for_grid(i.grid) for i in images]
        ids, offsets = expand_image_tokens(ids, mc.vision.image_token_id, counts, len(images))
        all_ids.append(ids)
        all_items.append([ImageItem(image_digest(f"{n}/{k}".encode()), o, c, i.patches, grid=i.grid)
                          for k, (o, c, i) in enumerate(zip(offsets, counts, images, strict=True))])
    return all_ids, all_items


def engine_greedy(folder: Path, **cfg) -> list[list[int]]:
    ids, items = prompts(folder)
    engine = Engine(EngineConfig(model=str(folder), device="cuda", dtype="float32", page_size=4,
                                 max_total_tokens=8192, max_running_requests=8, chunked_prefill_size=16, **cfg))
    engine.start()
    try:
        return generate_tokens(engine, ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                               timeout=300, images=items)
    finally:
        engine.stop()


def hf_greedy(folder: Path) -> list[list[int]]:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                           eos_token_id=None, pad_token_id=0)
    out = []
    for ids, items in zip(*prompts(folder), strict=True):
        inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": (torch.tensor([ids]) == 262).int()}
        if items:
            inputs["pixel_values"] = torch.cat([i.pixels for i in items])
            inputs["image_grid_thw"] = torch.tensor([i.grid for i in items])
        with torch.inference_mode():
            out.append(model.generate(**inputs, generation_config=config)[0, len(ids):].tolist())
    return out


def test_graphs_and_overlap_equal_eager_and_transformers(tmp_path: Path) -> None:
    folder = write_qwen_vl_checkpoint(tmp_path / "ckpt", seed=5)
    graphed = engine_greedy(folder)  # decode graphs + the overlap scheduler, the GPU default
    eager = engine_greedy(folder, disable_cuda_graph=True, disable_overlap=True)
    assert graphed == eager
    assert graphed == hf_greedy(folder)


def test_vision_tower_on_the_gpu_equals_transformers(tmp_path: Path) -> None:
    from splitserve.engine.checkpoints.weight_loader import load_weights
    from splitserve.engine.models import build_model

    folder = write_qwen_vl_checkpoint(tmp_path / "ckpt", seed=5)
    mc = ModelConfig.from_folder(folder)
    with torch.device("cuda"):
        model = build_model(mc)
    load_weights(model, folder, tied_lm_head=False)
    _, items = prompts(folder)
    images = [i for each in items for i in each]
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        got = model.encode_images([i.pixels.cuda() for i in images], [i.grid for i in images])
        want = hf.model.get_image_features(torch.cat([i.pixels for i in images]),
                                           torch.tensor([i.grid for i in images])).pooler_output
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)
