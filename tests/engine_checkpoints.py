"""Small random-weight checkpoints the engine tests write (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitserve.engine.tiny_model import write_checkpoint

LLAMA_GQA_LLAMA3_ROPE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 300, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
    "torch_dtype": "float32",
}

QWEN2_BIAS_TIED: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "vocab_size": 280, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 1024, "tie_word_embeddings": True, "hidden_act": "silu",
    "bos_token_id": 256, "eos_token_id": 257, "use_sliding_window": False, "torch_dtype": "float32",
}

CHECKPOINTS = {"llama-gqa-llama3rope": LLAMA_GQA_LLAMA3_ROPE, "qwen2-bias-tied": QWEN2_BIAS_TIED}


def write(kind: str, folder: Path, seed: int = 1234) -> Path:
    return write_checkpoint(folder, CHECKPOINTS[kind], seed)
