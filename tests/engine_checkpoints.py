"""Small random-weight checkpoints the engine tests write (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitserve.engine.checkpoints.gguf_tokenizer import byte_level_alphabet
from splitserve.engine.checkpoints.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, write_checkpoint

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


def llama_cpp_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter order for Q/K rows: each head's two RoPE halves interleaved."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_gguf(path: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], qtype_name: str = "F32",
               architecture: str = "llama", tokenizer_model: str = "gpt2",
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF file of a Llama `config` and its HF-named `weights`, as llama.cpp's converter lays it out:
    Q/K rows reordered, 2-D weights in `qtype_name` (1-D norms stay F32), the byte-level tokenizer
    of the tiny model (BOS added, as its post-processor does) and its chat template."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    alphabet = byte_level_alphabet()
    tokens = [alphabet[b] for b in range(256)] + SPECIAL_TOKENS
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * len(SPECIAL_TOKENS))
    writer.add_token_merges([])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in weights.items():
        values = tensor.float()
        if name.endswith("q_proj.weight"):
            values = llama_cpp_rope_rows(values, heads)
        elif name.endswith("k_proj.weight"):
            values = llama_cpp_rope_rows(values, kv_heads)
        array = values.numpy()
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def cpu_runner(folder: Path, max_running: int = 4) -> tuple[Any, Any]:
    """A float32 CPU ModelRunner of a checkpoint folder (pages of 4 tokens, 512 KV tokens, `max_running`
    requests) and a KVCache over its pool, as the model-level tests drive them."""
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.kv_cache import KVCache
    from splitserve.engine.runner.model_runner import ModelRunner

    cfg = EngineConfig(model=str(folder), device="cpu", dtype="float32", page_size=4, max_total_tokens=512,
                       max_running_requests=max_running)
    runner = ModelRunner(cfg, folder, ModelConfig.from_folder(folder))
    return runner, KVCache(runner.kv_shape.num_pages, cfg.page_size, max_running, 1024, runner.device)
