"""Small seeded random-weight Qwen2-VL and Qwen2.5-VL checkpoints in the hub's layout (flat text config,
`vision_config`, `rope_scaling` with the M-RoPE sections), with an image processor config and an image-aware
chat template: what the Qwen-VL tests and `splitserve up --model tiny-qwen2.5-vl` run, with no download.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from splitserve.engine.checkpoints.tiny_model import BOS, EOS, byte_level_tokenizer, random_llama_weights

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids 260..263
IMAGE_TOKEN = "<|image_pad|>"
# Renders OpenAI-style content parts (after the server maps image_url parts to {"type": "image"}), as Qwen's does.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT: dict[str, Any] = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 256, "eos_token_id": 257,
}
VISION = {
    "Qwen2VLForConditionalGeneration": {
        "model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
        "hidden_act": "quick_gelu", "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3},
    "Qwen2_5_VLForConditionalGeneration": {
        "model_type": "qwen2_5_vl", "depth": 3, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48,
        "num_heads": 2, "hidden_act": "silu", "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3, "window_size": 16, "fullatt_block_indexes": [1], "tokens_per_second": 2},
}
# Sides become multiples of 8 (patch 4 x merge 2), 4 to 64 merged tokens an image.
PREPROCESSOR = {"min_pixels": 8 * 8 * 4, "max_pixels": 8 * 8 * 64, "patch_size": 4, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor"}


def qwen_vl_config(architecture: str = "Qwen2_5_VLForConditionalGeneration") -> dict[str, Any]:
    vision = dict(VISION[architecture])
    model_type = vision.pop("model_type")
    return {"architectures": [architecture], "model_type": model_type, **TEXT,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": vision, "image_token_id": 262, "video_token_id": 263,
            "vision_start_token_id": 260, "vision_end_token_id": 261, "torch_dtype": "float32"}


def random_vision_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tower and merger weights in the hub's names (`visual.`), shaped by the engine's tower."""
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.models.qwen_vl_vision import QwenVisionTower

    vision = ModelConfig.from_dict(cfg).vision
    assert vision is not None
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in QwenVisionTower(vision, torch.float32).named_parameters():  # type: ignore[arg-type]
        if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif name.endswith(".bias"):
            value = 0.05 * torch.randn(param.shape, generator=gen)
        else:  # unit-ish output variance
            fan_in = param[0].numel()
            value = torch.randn(param.shape, generator=gen) * (1.2 / fan_in ** 0.5)
        out[f"visual.{name}"] = value
    return out


def write_qwen_vl_checkpoint(folder: str | Path, seed: int = 0,
                             architecture: str = "Qwen2_5_VLForConditionalGeneration") -> Path:
    """config.json, model.safetensors (hub layout), tokenizer, chat template and preprocessor config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = qwen_vl_config(architecture)
    text = {**TEXT, "architectures": ["Qwen2ForCausalLM"]}
    weights = random_llama_weights(text, seed)
    weights.update(random_vision_weights(cfg, seed + 1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = byte_level_tokenizer()
    tok.add_special_tokens(VISION_TOKENS)
    assert tok.token_to_id(IMAGE_TOKEN) == cfg["image_token_id"]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": TEXT["max_position_embeddings"], "chat_template": QWEN_VL_CHAT_TEMPLATE}, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    return folder


# Qwen2.5-VL-7B-Instruct's shape (its hub config), with this tokenizer's vision token ids: benchmarks run it with
# --load-format dummy (random weights of the shape, no checkpoint).
QWEN2_5_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 128000, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 256, "eos_token_id": 257, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584, "intermediate_size": 3420,
                      "num_heads": 16, "hidden_act": "silu", "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "in_channels": 3, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2},
    "image_token_id": 262, "video_token_id": 263, "vision_start_token_id": 260, "vision_end_token_id": 261,
    "torch_dtype": "bfloat16",
}


def write_qwen_vl_shape(folder: str | Path, config: dict[str, Any] = QWEN2_5_VL_7B,
                        max_pixels: int = 1344 * 1344) -> Path:
    """A weightless folder of a Qwen-VL shape (config, tokenizer, chat template, processor) for --load-format
    dummy; `max_pixels` bounds an image's tokens (and the embedding slots of encoder disaggregation)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok = byte_level_tokenizer()
    tok.add_special_tokens(VISION_TOKENS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"], "chat_template": QWEN_VL_CHAT_TEMPLATE}, indent=2))
    vision = config["vision_config"]
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    (folder / "preprocessor_config.json").write_text(json.dumps({
        **PREPROCESSOR, "min_pixels": 4 * factor ** 2, "max_pixels": max_pixels, "patch_size": vision["patch_size"],
        "merge_size": vision["spatial_merge_size"]}, indent=2))
    return folder


def tiny_qwen_vl_folder(seed: int = 0, architecture: str = "Qwen2_5_VLForConditionalGeneration") -> Path:
    """A tiny Qwen-VL's folder, written once into the user's cache and reused."""
    cache = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    folder = cache / f"tiny-{VISION[architecture]['model_type']}-seed{seed}-v1"
    if not (folder / "model.safetensors").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_qwen_vl_checkpoint(tmp, seed, architecture)
        with contextlib.suppress(OSError):
            tmp.rename(folder)
    return folder
