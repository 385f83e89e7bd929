"""The architecture of a Llama-family checkpoint, read from its Hugging Face `config.json` or from
a GGUF file's metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.engine.multimodal.qwen_vl_config import QWEN_VL_ARCHITECTURES, QwenVisionConfig
from splitserve.engine.multimodal.vision_config import MULTIMODAL_ARCHITECTURES, VisionConfig
from splitserve.engine.quantization.fp8 import Fp8Scheme, UnsupportedQuantizationError, scheme_from_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")

# A multimodal checkpoint's `text_config.model_type` -> the text architecture it is.
TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is not one this engine can run."""


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs from `config.json` (HF names, normalised)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    vision: VisionConfig | QwenVisionConfig | None = None  # a multimodal checkpoint's image side (None: text only)
    # FP8 projections: the checkpoint's (compressed-tensors, ModelOpt) or --quantization fp8's (docs/fp8.md)
    quantization: Fp8Scheme | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def mrope(self) -> bool:
        """Whether positions are multimodal (Qwen2-VL's M-RoPE: image tokens take (t, h, w) positions)."""
        return isinstance(self.vision, QwenVisionConfig)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if any(a in MULTIMODAL_ARCHITECTURES for a in archs):
            return cls._multimodal(cfg)
        if any(a in QWEN_VL_ARCHITECTURES for a in archs):
            return cls._qwen_vl(cfg)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures {archs} not supported; this engine runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES + MULTIMODAL_ARCHITECTURES + QWEN_VL_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} not supported (only silu)")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Qwen2 always has q/k/v bias and no `attention_bias` key; Llama/Mistral say so explicitly.
        attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        rope_theta, rope_scaling = _rope_settings(cfg)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=_quantization(cfg),
            raw=cfg,
        )

    @classmethod
    def _multimodal(cls, cfg: dict[str, Any]) -> ModelConfig:
        """A LLaVA checkpoint: the text model from `text_config`, the image side beside it."""
        text = dict(cfg.get("text_config") or {})
        model_type = text.get("model_type", "llama")
        if model_type not in TEXT_MODEL_TYPES:
            raise UnsupportedModelError(f"LLaVA text model {model_type!r} not supported "
                                        f"({', '.join(TEXT_MODEL_TYPES)})")
        text.setdefault("architectures", [TEXT_MODEL_TYPES[model_type]])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        base = cls.from_dict(text)
        vision = VisionConfig.from_llava(cfg, base.hidden_size)
        if not 0 <= vision.image_token_id < base.vocab_size:
            raise UnsupportedModelError(f"image_token_index {vision.image_token_id} is outside the vocabulary")
        return dataclasses.replace(base, vision=vision, quantization=_quantization(cfg), raw=cfg)

    @classmethod
    def _qwen_vl(cls, cfg: dict[str, Any]) -> ModelConfig:
        """A Qwen2-VL / Qwen2.5-VL checkpoint: a Qwen2 text model (from `text_config` as transformers 5 writes
        it, or the top level as the hub's folders have it) with M-RoPE, and the vision tower beside it."""
        text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise UnsupportedModelError(f"Qwen-VL rope type {kind!r} not supported (default M-RoPE)")
        theta = float(rope.get("rope_theta", text.get("rope_theta", 1000000.0)))
        # The sections go to the vision config; the text model's frequencies are plain RoPE's.
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        text.pop("rope_scaling", None)
        text["architectures"] = ["Qwen2ForCausalLM"]
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        text.setdefault("eos_token_id", cfg.get("eos_token_id"))
        text.setdefault("bos_token_id", cfg.get("bos_token_id"))
        base = cls.from_dict(text)
        try:
            vision = QwenVisionConfig.from_config(cfg, base.hidden_size, base.head_dim)
        except ValueError as exc:
            raise UnsupportedModelError(str(exc)) from exc
        if not 0 <= vision.image_token_id < base.vocab_size:
            raise UnsupportedModelError(f"image_token_id {vision.image_token_id} is outside the vocabulary")
        return dataclasses.replace(base, vision=vision, quantization=_quantization(cfg), raw=cfg)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        cfg = cls.from_dict(json.loads(path.read_text()))
        if cfg.quantization is None and (Path(folder) / "hf_quant_config.json").is_file():  # ModelOpt's own file
            cfg = dataclasses.replace(cfg, quantization=_quantization(cfg.raw, folder))
        return cfg

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        """The config of a checkpoint folder, a GGUF file, or a folder holding one GGUF file."""
        from splitserve.engine.checkpoints.gguf import find_gguf_file, open_gguf

        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return cls.from_dict(open_gguf(gguf_file).hf_config)
        return cls.from_folder(path)


def _quantization(cfg: dict[str, Any], folder: str | Path | None = None) -> Fp8Scheme | None:
    try:
        return scheme_from_config(cfg, folder)
    except UnsupportedQuantizationError as e:
        raise UnsupportedModelError(str(e)) from e


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
    if scaling is not None and kind not in ("llama3", "linear"):
        raise UnsupportedModelError(f"rope scaling type {kind!r} not supported (llama3, linear)")
    return theta, scaling
