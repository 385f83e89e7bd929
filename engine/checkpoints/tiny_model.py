"""The embedded default model: a small seeded random-weight Llama with a byte-level tokenizer.

It is written as an ordinary Hugging Face checkpoint folder, so it goes through exactly the
loading path a real model does, and a new user gets a running server with no download.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from splitserve.engine.checkpoints.gguf_tokenizer import byte_level_alphabet

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
# A ChatML-style template: what Qwen-style chat checkpoints ship in tokenizer_config.json.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens plus the special tokens (ids 256..), BOS added to every encoding."""
    vocab = {ch: byte for byte, ch in byte_level_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def random_llama_weights(config: dict[str, Any], seed: int, std: float = 0.08,
                         head_std: float = 0.25) -> dict[str, torch.Tensor]:
    """Seeded random weights in Hugging Face names for a Llama-family `config`.

    The LM head is drawn wider than the rest so that logits are well separated: greedy
    decoding then has clear winners, and engines agree token for token.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    bias = config.get("attention_bias", config["architectures"][0] == "Qwen2ForCausalLM")

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden, scale=head_std),
               "model.norm.weight": 1.0 + rand(hidden, scale=0.1)}
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = rand(config["vocab_size"], hidden, scale=head_std)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}.mlp.up_proj.weight": rand(inter, hidden),
            f"{p}.mlp.down_proj.weight": rand(hidden, inter),
            f"{p}.input_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
            f"{p}.post_attention_layernorm.weight": 1.0 + rand(hidden, scale=0.1),
        })
        if bias:
            weights[f"{p}.self_attn.q_proj.bias"] = rand(heads * head_dim)
            weights[f"{p}.self_attn.k_proj.bias"] = rand(kv_heads * head_dim)
            weights[f"{p}.self_attn.v_proj.bias"] = rand(kv_heads * head_dim)
    return weights


def write_checkpoint(folder: str | Path, config: dict[str, Any], seed: int,
                     chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Writes config.json, model.safetensors and the byte-level tokenizer files into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_llama_weights(config, seed)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    save_file({k: v.to(dtype).contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    tok_cfg: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
                               "model_max_length": config["max_position_embeddings"]}
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")})
    )
    return folder


def tiny_model_folder(seed: int = 0) -> Path:
    """The tiny checkpoint's folder, written once into the user's cache and reused."""
    cache = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
    folder = cache / f"tiny-llama-seed{seed}-v1"
    if not (folder / "model.safetensors").is_file():
        logger.info("writing the built-in tiny model to %s", folder)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_checkpoint(tmp, TINY_CONFIG, seed)
        # If another process wrote it first, theirs is identical (same seed): keep it.
        with contextlib.suppress(OSError):
            tmp.rename(folder)
    return folder
