"""A GGUF file as a checkpoint: the model's config from its metadata, and its tensors dequantized
to float32 under Hugging Face names, read with the `gguf` package.

llama.cpp's converter stores the Q and K projections of Llama-architecture models with the rows of
each head reordered for its interleaved RoPE; `tensors()` puts them back in the half-split order
that Hugging Face checkpoints (and this engine's rotary embedding) use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"

# GGUF architecture -> the Hugging Face architecture whose module layout it has.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# How often loading reports progress, in seconds.
PROGRESS_EVERY_S = 2.0


class GGUFError(ValueError):
    """The GGUF file is not one this engine can run (architecture, tensor type, tokenizer)."""


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only `*.gguf` in a folder; None if it is neither."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        raise GGUFError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                        "pass --model the one to run")
    return files[0] if files else None


@cache
def open_gguf(path: Path) -> GGUFCheckpoint:
    """The checkpoint of `path`, parsed once per process (the config, tokenizer and weights all read it)."""
    return GGUFCheckpoint(path)


def dequantizable(qtype: Any) -> bool:
    """Whether the installed `gguf` package can turn tensors of this type into floats."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block_bytes = GGML_QUANT_SIZES[qtype][1]
    try:
        dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row order: within each head it interleaves the two RoPE halves
    (rows 0, d/2, 1, d/2+1, ...); Hugging Face keeps the first half then the second."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: metadata, model config and dequantized tensors."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.architecture = str(self.value("general.architecture"))
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: GGUF architecture {self.architecture!r} not supported; "
                            f"this engine runs {', '.join(ARCHITECTURES)}")
        self.tensor_names = {t.name for t in self.reader.tensors}
        types = {t.tensor_type for t in self.reader.tensors}
        refused = sorted(kind.name for kind in types if not dequantizable(kind))
        if refused:
            raise GGUFError(f"{self.path.name}: tensor type(s) {', '.join(refused)} cannot be dequantized by the "
                            "installed gguf package")
        if "rope_freqs.weight" in self.tensor_names:
            raise GGUFError(f"{self.path.name}: per-frequency RoPE factors (rope_freqs, Llama 3.1 scaling) "
                            "are not supported")

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value (string, number, bool or list), or `default` if the file lacks it."""
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The model's `config.json`, as Hugging Face would write it, from the file's metadata."""
        heads = int(self.arch_value("attention.head_count"))
        kv_heads = self.arch_value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise GGUFError(f"{self.path.name}: a KV head count per layer is not supported")
        hidden = int(self.arch_value("embedding_length"))
        head_dim = self.arch_value("attention.key_length") or self.arch_value("rope.dimension_count")
        vocab = self.arch_value("vocab_size") or len(self.value("tokenizer.ggml.tokens", []))
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_value("feed_forward_length")),
            "num_hidden_layers": int(self.arch_value("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": int(head_dim or hidden // heads),
            "rms_norm_eps": float(self.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self.arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_value("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "hidden_act": "silu",
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
        }
        scaling = self.arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            # ModelConfig refuses the kinds the engine cannot run, by name.
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self.arch_value("rope.scaling.factor", 1.0))}
        return cfg

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of a GGUF tensor: `blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`."""
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
        if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
        raise GGUFError(f"{self.path.name}: unexpected tensor {name!r} for architecture {self.architecture!r}")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as (Hugging Face name, float32 tensor in Hugging Face layout), logging progress."""
        import torch  # here, not at the top: the router reads a GGUF file's tokenizer without torch
        from gguf.quants import dequantize

        heads = self.hf_config["num_attention_heads"]
        kv_heads = self.hf_config["num_key_value_heads"]
        total_bytes = sum(int(t.n_bytes) for t in self.reader.tensors)
        done_bytes, started, last_report = 0, time.monotonic(), 0.0
        for index, t in enumerate(self.reader.tensors, 1):
            name = self.hf_name(t.name)
            shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions innermost first
            values = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            values = values.reshape(shape)
            module = name.rsplit(".", 1)[0]
            if module.endswith("self_attn.q_proj"):
                values = unpermute_rope_rows(values, heads)
            elif module.endswith("self_attn.k_proj"):
                values = unpermute_rope_rows(values, kv_heads)
            yield name, values
            done_bytes += int(t.n_bytes)
            now = time.monotonic()
            if now - last_report >= PROGRESS_EVERY_S or index == len(self.reader.tensors):
                last_report = now
                logger.info("dequantized %s: %d/%d tensors, %.0f%% (%.1f s)", self.path.name, index,
                            len(self.reader.tensors), 100 * done_bytes / max(total_bytes, 1), now - started)
