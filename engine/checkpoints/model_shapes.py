"""Architectures of real models by name, for benchmarks with random weights (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, byte_level_tokenizer

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 128000,
    "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
QWEN2_5_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
LLAMA_3_2_1B: dict[str, Any] = {**LLAMA_3_1_8B, "hidden_size": 2048, "intermediate_size": 8192,
                                "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64,
                                "tie_word_embeddings": True}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": LLAMA_3_1_8B, "qwen2.5-7b": QWEN2_5_7B, "llama-3.2-1b": LLAMA_3_2_1B, "tiny": TINY_CONFIG,
}


def write_shape_folder(shape: str, folder: Path) -> Path:
    """A checkpoint folder with `shape`'s config.json and a byte-level tokenizer, but no weights
    (load it with --load-format dummy)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|end_of_text|>"}))
    return folder


def layer_projections(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, out_features N, in_features K) of a decoder layer's projections, fused as the engine fuses them."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def matmul_params(cfg: dict[str, Any]) -> int:
    """The decoder layers' projection weights: those that take part in every token's matrix products (the LM
    head, which only sampled tokens take, left out)."""
    return sum(n * k for _name, n, k in layer_projections(cfg)) * cfg["num_hidden_layers"]


def prompt_matmul_flops(cfg: dict[str, Any], tokens: int, sampled: int = 1) -> int:
    """Matrix-product FLOPs of a prompt of `tokens` tokens of which `sampled` take logits: every projection
    for every token, except the last layer's output projection and MLP, which only the sampled tokens need
    (LlamaForCausalLM.hidden_states drops the other rows there), and the LM head for the sampled ones."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    after_attention = heads * head_dim * hidden + 3 * hidden * inter
    weights_used = tokens * matmul_params(cfg) - (tokens - sampled) * after_attention
    return 2 * (weights_used + sampled * hidden * cfg["vocab_size"])
