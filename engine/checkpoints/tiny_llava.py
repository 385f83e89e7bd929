"""A small seeded random-weight LLaVA checkpoint (CLIP tower, MLP projector, Llama text model) in
the hub's layout, with a processor config and an image-aware chat template: what the multimodal
tests, `splitserve up --model tiny-llava` and the EPD benchmark run, with no download.
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

IMAGE_TOKEN = "<image>"
# Renders OpenAI-style content parts (after the server maps image_url parts to {"type": "image"}).
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257,
}
VISION_CONFIG: dict[str, Any] = {
    "model_type": "clip_vision_model", "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "image_size": 28, "patch_size": 7, "num_channels": 3, "layer_norm_eps": 1e-5,
    "hidden_act": "quick_gelu", "projection_dim": 32,
}


def llava_config(select_strategy: str = "default", feature_layer: int | list[int] = -2) -> dict[str, Any]:
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": dict(TEXT_CONFIG), "vision_config": dict(VISION_CONFIG),
        "image_token_index": 260, "projector_hidden_act": "gelu", "multimodal_projector_bias": True,
        "vision_feature_layer": feature_layer, "vision_feature_select_strategy": select_strategy,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def random_clip_weights(vision: dict[str, Any], text_hidden: int, feature_layers: int,
                        seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tower and projector weights, in the hub's names."""
    gen = torch.Generator().manual_seed(seed)
    d, inter = vision["hidden_size"], vision["intermediate_size"]
    patch, side = vision["patch_size"], vision["image_size"] // vision["patch_size"]

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": 1.0 + rand(d, scale=0.1), f"{prefix}.bias": rand(d, scale=0.05)}

    p = "vision_tower.vision_model"
    w = {f"{p}.embeddings.class_embedding": rand(d, scale=0.5),
         f"{p}.embeddings.patch_embedding.weight": rand(d, vision["num_channels"], patch, patch, scale=0.1),
         f"{p}.embeddings.position_embedding.weight": rand(side * side + 1, d, scale=0.2),
         **norm(f"{p}.pre_layrnorm"), **norm(f"{p}.post_layernorm")}
    for i in range(vision["num_hidden_layers"]):
        lp = f"{p}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{lp}.self_attn.{proj}.weight"] = rand(d, d, scale=0.15)
            w[f"{lp}.self_attn.{proj}.bias"] = rand(d, scale=0.05)
        w.update({f"{lp}.mlp.fc1.weight": rand(inter, d, scale=0.15), f"{lp}.mlp.fc1.bias": rand(inter, scale=0.05),
                  f"{lp}.mlp.fc2.weight": rand(d, inter, scale=0.15), f"{lp}.mlp.fc2.bias": rand(d, scale=0.05),
                  **norm(f"{lp}.layer_norm1"), **norm(f"{lp}.layer_norm2")})
    w.update({"multi_modal_projector.linear_1.weight": rand(text_hidden, d * feature_layers, scale=0.2),
              "multi_modal_projector.linear_1.bias": rand(text_hidden, scale=0.05),
              "multi_modal_projector.linear_2.weight": rand(text_hidden, text_hidden, scale=0.3),
              "multi_modal_projector.linear_2.bias": rand(text_hidden, scale=0.05)})
    return w


def write_llava_checkpoint(folder: str | Path, seed: int = 0, select_strategy: str = "default",
                           feature_layer: int | list[int] = -2) -> Path:
    """config.json, model.safetensors (hub layout), tokenizer, chat template and processor configs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = llava_config(select_strategy, feature_layer)
    text = {**cfg["text_config"], "architectures": ["LlamaForCausalLM"]}
    weights = {("language_model." + k): v for k, v in random_llama_weights(text, seed).items()}
    layers = len(feature_layer) if isinstance(feature_layer, list) else 1
    weights.update(random_clip_weights(cfg["vision_config"], text["hidden_size"], layers, seed + 1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = byte_level_tokenizer()
    tok.add_special_tokens([IMAGE_TOKEN])
    assert tok.token_to_id(IMAGE_TOKEN) == cfg["image_token_index"]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": text["max_position_embeddings"], "chat_template": LLAVA_CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": IMAGE_TOKEN}}, indent=2))
    size = cfg["vision_config"]["image_size"]
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": size, "width": size},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }, indent=2))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": cfg["vision_config"]["patch_size"],
        "vision_feature_select_strategy": select_strategy, "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    return folder


def tiny_llava_folder(seed: int = 0) -> Path:
    """The tiny LLaVA's folder, written once into the user's cache and reused."""
    cache = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    folder = cache / f"tiny-llava-seed{seed}-v1"
    if not (folder / "model.safetensors").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_llava_checkpoint(tmp, seed)
        with contextlib.suppress(OSError):
            tmp.rename(folder)
    return folder
