"""LLaVA in the engine equals transformers: preprocessing, placeholder expansion, logits with 0, 1 and
2 images over chunked prefill, in every checkpoint layout; the prefix cache keys images by hash."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_checkpoints import cpu_runner
from PIL import Image
from safetensors.torch import load_file, save_file

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.multimodal.image_items import ImageItem, ImagePlaceholderError, expand_image_tokens, image_digest
from splitserve.engine.multimodal.image_processor import ClipImageProcessor
from splitserve.engine.request import Request
from splitserve.engine.runner.model_runner import build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

transformers = pytest.importorskip("transformers")

PROMPTS = {  # rendered chat text with 0, 1 and 2 image placeholders
    0: "<|begin_of_text|><|im_start|>user\nwhat is up?<|im_end|>\n<|im_start|>assistant\n",
    1: "<|begin_of_text|><|im_start|>user\n<image>\ndescribe it<|im_end|>\n<|im_start|>assistant\n",
    2: "<|begin_of_text|><|im_start|>user\nleft <image> right<image><|im_end|>\n<|im_start|>assistant\n",
}


def sample_images(seed: int = 0) -> list[Image.Image]:
    """Mixed sizes and modes: wide RGB, tall RGBA (transparency), grayscale, palette, one under the crop."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (40, 57, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (90, 31, 4), dtype=np.uint8), "RGBA"),
        Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8), "L"),
        Image.fromarray(rng.integers(0, 256, (64, 48, 3), dtype=np.uint8)).convert("P"),
        Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)),
    ]


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory) -> Path:
    return write_llava_checkpoint(tmp_path_factory.mktemp("llava-hub"), seed=3)


def relayout(src: Path, dst: Path, rename) -> Path:
    """A copy of `src` whose tensors carry other names (another transformers version's layout)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({rename(k): v for k, v in load_file(src / "model.safetensors").items()}, str(dst / "model.safetensors"))
    return dst


def transformers_saved(src: Path, dst: Path) -> Path:
    """What this transformers version writes for the same checkpoint: `LlavaForConditionalGeneration` and
    `LlavaProcessor` each loaded from `src` and saved with save_pretrained, nothing copied. Transformers 5 puts the
    image processor's settings under `image_processor` in `processor_config.json` and writes no
    `preprocessor_config.json`; where the installed transformers (4.x) still writes that file, its settings are
    moved into `processor_config.json` under `image_processor` here, as transformers 5 does, so the folder has
    the transformers-5 layout whichever version made it."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst)
    transformers.AutoProcessor.from_pretrained(src).save_pretrained(dst)
    preprocessor = dst / "preprocessor_config.json"
    if preprocessor.is_file():
        processor_path = dst / "processor_config.json"
        processor = json.loads(processor_path.read_text()) if processor_path.is_file() else {}
        processor["image_processor"] = json.loads(preprocessor.read_text())
        processor_path.write_text(json.dumps(processor, indent=2))
        preprocessor.unlink()
    return dst


@pytest.fixture(scope="module")
def saved_checkpoint(hub_checkpoint: Path, tmp_path_factory) -> Path:
    folder = transformers_saved(hub_checkpoint, tmp_path_factory.mktemp("llava-saved"))
    assert not (folder / "preprocessor_config.json").exists()
    nested = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    assert nested["crop_size"] == {"height": 28, "width": 28}
    return folder


def v4_layout(name: str) -> str:  # transformers 4.52-4.57: model.language_model / model.vision_tower
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def engine_logits(folder: Path, ids: list[int], images: list[ImageItem], splits: list[int]) -> torch.Tensor:
    """Every position's logits from the engine's runner, the prompt run in chunks cut at `splits`."""
    runner, kv = cpu_runner(folder, max_running=2)
    req = Request("r", list(ids), SamplingParams(), on_output=lambda _o: None)
    req.images = images
    kv.admit(req, max_prefix_tokens=0)
    out = []
    bounds = [0, *splits, len(ids)]
    with torch.inference_mode():
        for start, end in itertools.pairwise(bounds):
            assert kv.grow(req, end)
            chunks = [ScheduledChunk(req, start, end - start, True)]
            batch = build_forward_batch(chunks, kv.page_table, kv.page_size, runner.device)
            batch.logits_index = torch.arange(end - start)
            if images:
                batch.image_rows, batch.image_positions = runner.prompt_image_rows(chunks)
            out.append(runner.model(batch, runner.kv_pool))
            req.kv_len = end
    return torch.cat(out)


def pil_image_processor(folder: Path):
    """transformers' CLIP processor on PIL, the reference ClipImageProcessor follows. transformers 5 picks its
    torchvision backend wherever torchvision is installed (the GPU image), whose resize differs from PIL's."""
    pil = getattr(transformers, "CLIPImageProcessorPil", None)  # transformers >= 5
    return pil.from_pretrained(folder) if pil else transformers.AutoImageProcessor.from_pretrained(folder)


def transformers_composites_transparency() -> bool:
    """Whether this transformers turns a transparent pixel white, as ours does (5.24 does; 5.17 drops alpha)."""
    from transformers.image_transforms import convert_to_rgb

    return np.array(convert_to_rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 0)))).reshape(-1).tolist() == [255] * 3


def assert_preprocessing_equals_transformers(folder: Path, crop: tuple[int, int] = (28, 28)) -> None:
    ours = ClipImageProcessor.from_folder(folder)
    hf = pil_image_processor(folder)
    composites = transformers_composites_transparency()
    for image in sample_images():
        want = hf(images=[image], return_tensors="pt")["pixel_values"][0]
        # Where this transformers drops alpha, the rest of its pipeline is still compared, on what it saw.
        opaque = image.mode == "RGBA" and not composites
        got = ours(image.convert("RGB") if opaque else image)
        assert got.shape == want.shape == (3, *crop)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_preprocessing_equals_transformers_image_processor(hub_checkpoint: Path) -> None:
    """The hub layout: `preprocessor_config.json` (what transformers 4 writes), a processor_config.json
    without the image processor in it."""
    assert "image_processor" not in json.loads((hub_checkpoint / "processor_config.json").read_text())
    assert_preprocessing_equals_transformers(hub_checkpoint)


def test_preprocessing_from_transformers_5_processor_config(saved_checkpoint: Path) -> None:
    """The transformers-5 layout: no preprocessor_config.json, the settings nested in processor_config.json."""
    assert_preprocessing_equals_transformers(saved_checkpoint)


def test_nested_image_processor_wins_over_preprocessor_config(hub_checkpoint: Path, tmp_path: Path) -> None:
    """With both files there, the nested settings are the ones used, as transformers does."""
    folder = relayout(hub_checkpoint, tmp_path / "both", lambda name: name)
    processor = json.loads((folder / "processor_config.json").read_text())
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    processor["image_processor"] = {**settings, "size": {"shortest_edge": 21}, "crop_size": {"height": 14,
                                                                                             "width": 21}}
    (folder / "processor_config.json").write_text(json.dumps(processor))
    assert_preprocessing_equals_transformers(folder, crop=(14, 21))


def test_folder_without_image_processor_settings_names_both_files(hub_checkpoint: Path, tmp_path: Path) -> None:
    folder = relayout(hub_checkpoint, tmp_path / "none", lambda name: name)
    (folder / "preprocessor_config.json").unlink()  # processor_config.json stays, with no image_processor
    with pytest.raises(FileNotFoundError, match=r"preprocessor_config\.json.*processor_config\.json"):
        ClipImageProcessor.from_folder(folder)
    (folder / "processor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"preprocessor_config\.json.*processor_config\.json"):
        ClipImageProcessor.from_folder(folder)


def test_transparency_is_composited_over_white() -> None:
    # No resize, no normalization: the tensor is the composited pixels / 255.
    processor = ClipImageProcessor.from_dict({"do_resize": False, "crop_size": 4, "do_normalize": False})
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[:2] = (255, 0, 0, 255)  # opaque red over a clear half
    rgba[2:] = (0, 0, 255, 0)
    got = processor(Image.fromarray(rgba, "RGBA"))
    torch.testing.assert_close(got[:, :2], torch.tensor([1.0, 0.0, 0.0])[:, None, None].expand(3, 2, 4))
    torch.testing.assert_close(got[:, 2:], torch.ones(3, 2, 4))


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_placeholders_expand_as_the_transformers_processor_does(tmp_path: Path, strategy: str) -> None:
    folder = write_llava_checkpoint(tmp_path, seed=1, select_strategy=strategy)
    vision = ModelConfig.from_folder(folder).vision
    assert vision is not None and vision.tokens_per_image == 16 + (strategy == "full")
    proc = transformers.AutoProcessor.from_pretrained(folder)
    tok = TextTokenizer(folder)
    for n, text in PROMPTS.items():
        images = sample_images()[:n]
        want = proc(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        got, offsets = expand_image_tokens(tok.encode(text, add_special_tokens=False), vision.image_token_id,
                                           vision.tokens_per_image, n)
        assert got == want.tolist()
        run = [vision.image_token_id] * vision.tokens_per_image
        assert [got[o:o + vision.tokens_per_image] for o in offsets] == [run] * n
    with pytest.raises(ImagePlaceholderError, match="2 image placeholder"):
        expand_image_tokens(tok.encode(PROMPTS[2], add_special_tokens=False), vision.image_token_id, 16, 1)


@pytest.mark.parametrize("layout", ["hub", "transformers-save_pretrained", "transformers-4.5x"])
def test_logits_equal_transformers_for_0_1_2_images(hub_checkpoint: Path, saved_checkpoint: Path, tmp_path: Path,
                                                    layout: str) -> None:
    """hub: our writer's folder (preprocessor_config.json); transformers-save_pretrained: model and processor
    saved by the installed transformers (transformers 5: processor_config.json with the image processor nested);
    transformers-4.5x: 4.52-4.57 tensor names with preprocessor_config.json."""
    folder = {"hub": lambda: hub_checkpoint, "transformers-save_pretrained": lambda: saved_checkpoint,
              "transformers-4.5x": lambda: relayout(hub_checkpoint, tmp_path / "v4", v4_layout)}[layout]()
    names = load_file(folder / "model.safetensors").keys()
    assert any(n.startswith({"hub": "vision_tower.vision_model.", "transformers-save_pretrained": "vision_tower.",
                             "transformers-4.5x": "model.vision_tower."}[layout]) for n in names)
    reference = saved_checkpoint if layout == "transformers-save_pretrained" else hub_checkpoint
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(reference, dtype=torch.float32).eval()
    proc = transformers.AutoProcessor.from_pretrained(reference)
    mc = ModelConfig.from_folder(folder)
    assert mc.vision is not None
    ClipImageProcessor.from_folder(folder)  # the folder's preprocessing loads (its equality has its own tests)
    for n, text in PROMPTS.items():
        images = sample_images(seed=n)[:n]
        hf_in = proc(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            want = hf(**hf_in).logits[0]
        ids = hf_in["input_ids"][0].tolist()
        _, offsets = expand_image_tokens(TextTokenizer(folder).encode(text, add_special_tokens=False),
                                         mc.vision.image_token_id, mc.vision.tokens_per_image, n)
        # The model on both sides gets transformers' pixels: preprocessing has its own test above.
        items = [ImageItem(f"{i:064x}", o, mc.vision.tokens_per_image, pixels)
                 for i, (o, pixels) in enumerate(zip(offsets, hf_in.get("pixel_values", []), strict=True))]
        # Chunk boundaries inside the first image and between the images.
        splits = [offsets[0] + 5, offsets[-1] + 9] if n else [7]
        got = engine_logits(folder, ids, items, sorted(set(splits)))
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_feature_layer_list_and_full_strategy_equal_transformers(tmp_path: Path) -> None:
    folder = write_llava_checkpoint(tmp_path, seed=5, select_strategy="full", feature_layer=[-3, -1])
    config = json.loads((folder / "config.json").read_text())
    assert config["vision_feature_layer"] == [-3, -1]
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    proc = transformers.AutoProcessor.from_pretrained(folder)
    images = sample_images(seed=9)[:2]
    hf_in = proc(text=PROMPTS[2], images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        want = hf(**hf_in).logits[0]
    mc = ModelConfig.from_folder(folder)
    ids = hf_in["input_ids"][0].tolist()
    offsets = [i for i, t in enumerate(ids) if t == mc.vision.image_token_id
               and (i == 0 or ids[i - 1] != mc.vision.image_token_id)]
    items = [ImageItem(f"{i:064x}", o, mc.vision.tokens_per_image, pixels)
             for i, (o, pixels) in enumerate(zip(offsets, hf_in["pixel_values"], strict=True))]
    torch.testing.assert_close(engine_logits(folder, ids, items, []), want, atol=2e-4, rtol=2e-4)


def test_prefix_cache_never_shares_kv_between_different_images() -> None:
    kv = KVCache(num_pages=64, page_size=4, max_slots=4, max_context=256, device=torch.device("cpu"))
    ids = [1, 2, 3, 4] + [260] * 16 + [5, 6, 7, 8, 9]

    def request(rid: str, image_bytes: bytes) -> Request:
        req = Request(rid, list(ids), SamplingParams(), on_output=lambda _o: None)
        req.images = [ImageItem(image_digest(image_bytes), 4, 16)]
        return req

    first = request("a", b"image one")
    kv.admit(first, max_prefix_tokens=len(ids) - 1)
    assert kv.grow(first, len(ids))
    first.kv_len = len(ids)
    kv.release(first)
    other = request("b", b"image two")  # same tokens, another image: only the text before it is shared
    kv.admit(other, max_prefix_tokens=len(ids) - 1)
    assert other.cached_len == 4
    kv.release(other)
    same = request("c", b"image one")  # the same image again: its pages are reused
    kv.admit(same, max_prefix_tokens=len(ids) - 1)
    assert same.cached_len == 24  # every full page of the prompt
    kv.release(same)
    assert kv.usage().locked == 0 and kv.usage().slots_in_use == 0
